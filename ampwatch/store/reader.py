"""Reading run files: always read-only, never migrating, with one clear line when a file is bad."""
from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pandas as pd

from .guard import damaged_tables, guard, open_read_only, read_error, read_only_uri, reads, truncation_error
from ..errors import RunError
from .schema import LAYER_NAN_BITS, SCHEMA_VERSION, STEP_NAN_BITS
from ..userpath import path_text

_SQLITE_MAGIC = b"SQLite format 3\x00"
RUN_SUFFIXES = (".sqlite", ".db", ".sqlite3")
# A writer stamps a heartbeat every flush (1 s by default); this much silence means it is gone.
STALE_AFTER_S = 30.0


def check_run_file(path: Any) -> Path:
    """The path as a Path if it names a readable file that looks like SQLite, else RunError."""
    p = Path(path_text(path, RunError, "the run file", "runs/exp1.sqlite"))
    if not p.exists():
        raise RunError(f"no run file at {str(p)!r}: check the path (runs are .sqlite files)")
    if p.is_dir():
        raise RunError(f"{str(p)!r} is a folder, not a run file: pass one .sqlite file, or use `ampwatch ls {p}`")
    try:
        with open(p, "rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise RunError(f"cannot read {str(p)!r}: {exc.strerror}") from None
    if head != _SQLITE_MAGIC:
        what = "an empty file" if not head else "not a SQLite file"
        raise RunError(f"{str(p)!r} is not an ampwatch run ({what}): pass a file written by ampwatch.attach")
    return p


@contextmanager
def connect(path: Any) -> Iterator[sqlite3.Connection]:
    """A read-only connection to a checked run file (``mode=ro``: this process cannot write it).

    Whatever fails inside the ``with`` block on a damaged file becomes one RunError line
    (:func:`ampwatch.store.guard.guard`); text that is not UTF-8 reads with U+FFFD instead of raising.
    For a whole run (schema and run row checked too) use :func:`open_run`."""
    with _connected(check_run_file(path)) as conn:
        yield conn


@contextmanager
def paired(path_a: Any, path_b: Any) -> Iterator[sqlite3.Connection]:
    """One read-only connection to two checked run files: ``path_a`` as ``main``, ``path_b``
    ATTACHed read-only as ``b``. For comparisons over tables too long to read into pandas (a
    1M-step run's 10M layer rows): SQLite matches and reduces the rows without the GIL. The
    caller's own tables go in the connection's ``temp`` schema, never in either file. A failure
    inside the block is one RunError line naming the file to blame (the damaged one of the two)."""
    a, b = check_run_file(path_a), check_run_file(path_b)
    try:
        conn = open_read_only(a)
    except sqlite3.Error as exc:
        raise RunError(f"cannot open {str(a)!r} read-only: {exc}") from None
    try:
        try:
            conn.execute("ATTACH DATABASE ? AS b", (read_only_uri(b),))
        except sqlite3.Error as exc:
            raise RunError(f"cannot open {str(b)!r} read-only: {exc}") from None
        yield conn
    except RunError:
        raise
    except Exception as exc:  # noqa: BLE001 - which file is to blame, else re-raised
        damaged = [p for p in (a, b) if not p.is_file() or truncation_error(p) is not None or damaged_tables(p)]
        error = read_error(damaged[0] if damaged else a, exc)
        if error is None:
            raise
        raise error from None
    finally:
        conn.close()


@contextmanager
def _connected(p: Path, factory: type = sqlite3.Connection) -> Iterator[Any]:
    try:
        conn = open_read_only(p, factory)
    except sqlite3.Error as exc:
        raise RunError(f"cannot open {str(p)!r} read-only: {exc}") from None
    try:
        with guard(p):
            yield conn
    finally:
        conn.close()


class RunConnection(sqlite3.Connection):
    """A read-only connection to a checked ampwatch run, from :func:`open_run`: ``path`` (the
    checked file) and ``run_row`` (its run row as stored, read once)."""
    path: Path
    run_row: dict[str, Any]


@contextmanager
def open_run(path: Any) -> Iterator[RunConnection]:
    """The one way to open a run: the path checked once, a read-only connection, the schema checked
    once, the run row read once. Anything else raises :class:`RunError` with one line.

    >>> with open_run("runs/exp1.sqlite") as conn:
    ...     conn.run_row["name"], conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    """
    p = check_run_file(path)
    with _connected(p, RunConnection) as conn:
        check_schema(conn, p)
        cur = conn.execute("SELECT * FROM run WHERE id = 1")
        row = cur.fetchone()
        if row is None:
            raise RunError(f"{str(p)!r} has no run row: it is not a complete ampwatch run")
        conn.path = p
        conn.run_row = dict(zip([d[0] for d in cur.description], row))
        yield conn


def check_schema(conn: sqlite3.Connection, p: Path) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"run", "steps", "tensors"} <= tables:
        raise RunError(f"{str(p)!r} is a SQLite file of another tool, not an ampwatch run")
    if version > SCHEMA_VERSION:
        raise RunError(f"{str(p)!r} was written by a newer ampwatch (schema {version}, this one reads "
                       f"up to {SCHEMA_VERSION}): upgrade ampwatch (pip install -U ampwatch)")


def has_table(conn: sqlite3.Connection, name: str) -> bool:
    """Whether the run file open on ``conn`` has table ``name``. Files of older schemas lack the
    tables added since (``memory``: schema 7), and a reader never migrates them: every reader of
    such a table asks here first."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def pid_alive(pid: Optional[int]) -> bool:
    if not isinstance(pid, int) or pid <= 0:  # 0 or negative would ask about a process group
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def effective_status(row: dict[str, Any], now: Optional[float] = None) -> str:
    """'running' only while the writer is alive: a silent heartbeat or a dead pid is 'interrupted'."""
    status = row.get("status") or "running"
    if status != "running":
        return status
    import socket
    if row.get("hostname") == socket.gethostname() and not pid_alive(row.get("pid")):
        return "interrupted"
    beat = row.get("heartbeat_at") or row.get("started_at") or 0
    if (now or time.time()) - beat > STALE_AFTER_S:
        return "interrupted"
    return "running"




def decode_nan_mask(df: pd.DataFrame, bits: dict[str, int], *, mask: Any = None, flags: Any = (),
                    drop: bool = True) -> pd.DataFrame:
    """Put back the NaNs that SQLite stored as NULL: where a row's ``nan_mask`` has a column's bit
    (:data:`~ampwatch.store.schema.STEP_NAN_BITS`, ``LAYER_NAN_BITS``) that column was NaN; a NULL
    without the bit was not measured (also NaN in pandas). The columns become floats.

    :param mask: the masks when they are not the frame's ``nan_mask`` column.
    :param flags: columns that also get a boolean ``<col>_nan`` (NaN, not merely unmeasured).
    :param drop: drop the ``nan_mask`` column afterwards.
    """
    raw = df["nan_mask"].to_numpy() if mask is None else mask
    m = np.nan_to_num(np.asarray(raw, dtype=float)).astype(np.int64)
    for col, bit in bits.items():
        hit = (m & bit) != 0
        df[col] = df[col].astype(float).where(~hit, np.nan)
        if col in flags:
            df[f"{col}_nan"] = hit
    return df.drop(columns=["nan_mask"]) if drop and "nan_mask" in df.columns else df


def _steps(df: pd.DataFrame) -> pd.DataFrame:
    df = decode_nan_mask(df, STEP_NAN_BITS)
    df["loss_scale"] = df["loss_scale"].astype(float)
    df["skipped"] = df["skipped"].astype(bool)
    return df


def _layers(df: pd.DataFrame) -> pd.DataFrame:
    df = decode_nan_mask(df, LAYER_NAN_BITS)
    df["grad_zero_frac"] = df["grad_zero_frac"].astype(float)
    # a count: a column with a NULL (not counted) would read as floats, 128.0
    df["grad_nonfinite"] = df["grad_nonfinite"].astype("Int64")
    return df


def _modules(df: pd.DataFrame) -> pd.DataFrame:
    df["amax"] = df["amax"].astype(float)
    df["nonfinite"] = df["nonfinite"].astype(bool)
    return df


def _events(df: pd.DataFrame) -> pd.DataFrame:
    df["origin"] = df["origin"].astype(bool)
    df["amax"] = df["amax"].astype(float)
    df["count"] = df["count"].astype("Int64")  # NULL (not counted) reads <NA>; 12448, not 12448.0
    df["micro_batch"] = df["micro_batch"].astype("Int64")  # NULL (per-step events, old files) reads <NA>
    # SQLite keeps NaN as NULL: fp32_nan/lowp_nan tell a NaN recompute from "not recomputed" (None).
    for col in ("fp32", "lowp"):
        nan = df.pop(f"{col}_nan").fillna(0).astype(int).to_numpy() == 1
        df[f"{col}_amax"] = pd.Series([math.nan if n else (None if v is None or v != v else float(v))
                                       for n, v in zip(nan, df[f"{col}_amax"].astype(object))],
                                      index=df.index, dtype=object)
    df["flows_into"] = df["flows_into"].astype(object).where(df["flows_into"].notna(), None)
    return df


def _metrics(df: pd.DataFrame) -> pd.DataFrame:
    df["value"] = df["value"].astype(float)
    return df


class Run:
    """A recorded run, opened read-only. Tables are read on first access and cached.

    ``info`` (dict), ``steps``, ``layers``, ``modules``, ``events``, ``metrics``, ``notices``
    (pandas DataFrames). Raises :class:`RunError` for anything that is not a readable run.
    """

    def __init__(self, path: Any) -> None:
        with open_run(path) as conn:
            self.path, self._row = conn.path, conn.run_row
        self._cache: dict[str, pd.DataFrame] = {}

    @property
    @reads
    def name(self) -> str:
        return str(self._row["name"])

    @property
    @reads
    def info(self) -> dict[str, Any]:
        row = self._row
        info = {k: v for k, v in row.items() if k not in ("id", "config_json")}
        info["status"] = effective_status(row)
        info["scaler_enabled"] = bool(row.get("scaler_enabled"))
        info["localize"] = bool(row.get("localize"))
        # Runs before schema 4 stored the mean of the values scaler.scale() saw, and
        # read as written: a NULL definition says so.
        info["loss_definition"] = row.get("loss_definition") or "scaled-mean"
        info.setdefault("clip_max_norm", None)
        try:
            info["config"] = json.loads(row.get("config_json") or "{}")
        except (ValueError, TypeError):
            info["config"] = {}
        return info

    @reads
    def query(self, sql: str, params: tuple = ()) -> pd.DataFrame:
        """Run a parameterised read-only query against the run file."""
        with connect(self.path) as conn:
            return pd.read_sql_query(sql, conn, params=params)

    def _table(self, key: str, sql: str, convert: Callable[[pd.DataFrame], pd.DataFrame] = lambda df: df
               ) -> pd.DataFrame:
        """A table read once and cached; ``convert`` runs under the same damage guard as the read
        (a flipped type byte shows up only when a column is converted)."""
        if key not in self._cache:
            with guard(self.path):
                self._cache[key] = convert(self.query(sql))
        return self._cache[key].copy()

    @property
    def steps(self) -> pd.DataFrame:
        return self._table("steps", "SELECT step, time, duration_s, loss, loss_scale, skipped, grad_norm, lr,"
                                    " micro_batches, nan_mask FROM steps ORDER BY step", _steps)

    @property
    def layers(self) -> pd.DataFrame:
        return self._table("layers", "SELECT l.step, t.name, l.grad_norm, l.grad_amax, l.param_norm,"
                                     " l.grad_nonfinite, l.grad_zero_frac, l.nan_mask FROM layers l"
                                     " JOIN tensors t ON t.id = l.param_id ORDER BY l.step, l.param_id", _layers)

    @property
    def modules(self) -> pd.DataFrame:
        return self._table("modules", "SELECT m.step, t.name AS module, CASE m.phase WHEN 0 THEN 'forward'"
                                      " ELSE 'backward' END AS phase, m.amax, m.nonfinite FROM modules m"
                                      " JOIN tensors t ON t.id = m.module_id ORDER BY m.step, m.module_id, m.phase",
                           _modules)

    @property
    def events(self) -> pd.DataFrame:
        """NaN/Inf events. ``micro_batch``: the micro-batch of the step in which this module and
        phase first went non-finite (None for param_grad/loss events and files before schema 2).
        ``fp32_amax`` (forward origins): the max |output| of the module recomputed in fp32, as float
        NaN/inf where the recompute gave them and None where none was done (files written before
        schema 3 read as None); ``flows_into``: for an origin in a container's own code, the child
        the non-finite value went into (else None); ``lowp_amax`` (forward origins whose fp32
        recompute was finite, schema 5): the max |output| of the module re-run in the dtypes and
        autocast state of its call, float NaN/inf or None like ``fp32_amax``."""
        with guard(self.path), connect(self.path) as conn:
            extra = event_columns(conn)
        df = self._table("events", f"SELECT step, phase, module, kind, count, amax, dtype, origin{extra}"
                                   f" FROM events ORDER BY step, origin DESC, id", _events)
        others = self.aliases()
        df["aliases"] = [", ".join(others.get(m, ())) for m in df["module"]]
        return df

    def aliases(self) -> dict[str, list[str]]:
        """Every name of a tied parameter or shared module -> its other names (empty for older runs)."""
        if "aliases" not in self._cache:
            with guard(self.path), connect(self.path) as conn:
                self._cache["aliases"] = aliases_in(conn)  # type: ignore[assignment]
        return self._cache["aliases"]  # type: ignore[return-value]

    @property
    def metrics(self) -> pd.DataFrame:
        return self._table("metrics", "SELECT step, key, value FROM metrics ORDER BY step, key", _metrics)

    @property
    def memory(self) -> pd.DataFrame:
        """The process's memory in bytes, read at each commit (schema 7): ``step, host_rss,
        device_allocated, device_reserved``; NaN where not read; empty for older files."""
        columns = ["step", "host_rss", "device_allocated", "device_reserved"]
        with guard(self.path), connect(self.path) as conn:
            known = has_table(conn, "memory")
        if not known:
            return pd.DataFrame({c: pd.Series(dtype="int64" if c == "step" else "float64") for c in columns})
        return self._table("memory", f"SELECT {', '.join(columns)} FROM memory ORDER BY step",
                           lambda df: df.astype({c: "float64" for c in columns[1:]}))

    @property
    def batches(self) -> pd.DataFrame:
        """The model's inputs saved from steps whose loss or outputs went NaN/Inf (schema 8), one row
        per tensor: ``step, micro_batch, name, dtype, shape`` (a list), ``nbytes, sha256, saved``
        (False: over the budget, listed without its bytes). The bytes: :meth:`batch`."""
        columns = ["step", "micro_batch", "name", "dtype", "shape", "nbytes", "sha256"]
        with guard(self.path), connect(self.path) as conn:
            known = has_table(conn, "batches")
        if not known:
            empty = pd.DataFrame({c: pd.Series(dtype="int64" if c in ("step", "micro_batch", "nbytes") else "object")
                                  for c in columns})
            empty["saved"] = pd.Series(dtype="bool")
            return empty

        def convert(df: pd.DataFrame) -> pd.DataFrame:
            df["shape"] = [json.loads(v) for v in df["shape"]]
            df["saved"] = df["sha256"].notna()
            return df
        return self._table("batches", f"SELECT {', '.join(columns)} FROM batches ORDER BY step, micro_batch, name",
                           convert)

    def batch_bytes(self, step: int, micro_batch: Optional[int] = None) -> list[tuple[str, str, list, Optional[bytes]]]:
        """The saved inputs of ``step`` as ``(name, dtype, shape, data)``, data None where not saved;
        ``micro_batch`` None: the first one saved. :class:`RunError` when the step has none."""
        saved = self.batches
        at = saved[saved["step"] == step]
        if micro_batch is not None:
            at = at[at["micro_batch"] == micro_batch]
        if at.empty:
            steps = sorted(set(int(v) for v in saved["step"]))
            where = f"step {step}" + (f" micro-batch {micro_batch}" if micro_batch is not None else "")
            listed = f"steps with saved inputs: {', '.join(map(str, steps))}" if steps else "no step's inputs were saved"
            raise RunError(f"no saved inputs for {where} in {self.path}: {listed} (Run.batches)")
        mb = int(at["micro_batch"].min())
        with guard(self.path), connect(self.path) as conn:
            rows = conn.execute("SELECT name, dtype, shape, data FROM batches WHERE step = ? AND micro_batch = ?"
                                " ORDER BY name", (int(step), mb)).fetchall()
        return [(name, dtype, json.loads(shape), data) for name, dtype, shape, data in rows]

    def batch(self, step: int, micro_batch: Optional[int] = None) -> dict[str, np.ndarray]:
        """The saved inputs of ``step`` (``micro_batch`` None: the first saved) as numpy arrays by
        name (``args[0]``, ``kwargs['input_ids']``). A dtype numpy lacks comes as its raw bits
        (bfloat16 as uint16, float8 as uint8); :func:`ampwatch.load_batch` gives torch tensors.
        A tensor listed but not saved (over the budget) is left out."""
        out: dict[str, np.ndarray] = {}
        for name, dtype, shape, data in self.batch_bytes(step, micro_batch):
            if data is not None:
                out[name] = np.frombuffer(data, dtype=_numpy_dtype(dtype)).reshape(shape)
        return out

    @property
    def notices(self) -> pd.DataFrame:
        return self._table("notices", "SELECT step, code, message FROM notices ORDER BY step")

    @property
    def tensors(self) -> pd.DataFrame:
        df = self._table("tensors", "SELECT id, kind, name, type, shape, numel, trainable FROM tensors")
        others = self.aliases()
        df["aliases"] = [", ".join(others.get(n, ())) for n in df["name"]]
        return df

    def exported(self, table: str) -> pd.DataFrame:
        """``table`` (steps, layers, modules, events, metrics) as ``ampwatch export`` writes it: the
        property's columns, with a NaN kept apart from "not measured" (NULL). Columns that can hold
        a NaN the file records as one (``nan_mask``'s bits, ``fp32_nan``/``lowp_nan``, a metric's
        NULL value: a metric row is written only for a logged value, so NULL there is a logged NaN)
        are pandas' nullable ``Float64``: NaN where the value was NaN, ``pd.NA`` where it is NULL.
        Counts (``count``, ``grad_nonfinite``, ``micro_batches``) are ``Int64``: 12448, never
        12448.0, with ``pd.NA`` (an empty cell) where they were not counted."""
        if table not in EXPORTED_TABLES:
            raise ValueError(f"no exported table {table!r}: one of {', '.join(EXPORTED_TABLES)}")
        with guard(self.path):
            return _EXPORT[table](self)

    def __repr__(self) -> str:
        return f"<ampwatch.Run {self.name!r} {str(self.path)!r}>"


def _nan_apart(values: Any, nan: Any) -> pd.arrays.FloatingArray:
    """Floats whose NaNs (where ``nan`` is true) stay NaN and whose other missing values (NULL)
    become ``pd.NA``: CSV writes them ``nan`` and an empty cell, Parquet NaN and null."""
    v = np.array(values, dtype=float)  # a copy: the array owns it
    return pd.arrays.FloatingArray(v, np.isnan(v) & ~np.asarray(nan, dtype=bool))


def _masked(run: Run, sql: str, bits: dict[str, int], ints: tuple) -> pd.DataFrame:
    df = run.query(sql)
    mask = np.nan_to_num(np.asarray(df.pop("nan_mask").to_numpy(), dtype=float)).astype(np.int64)
    for col, bit in bits.items():
        df[col] = _nan_apart(df[col], (mask & bit) != 0)
    for col in ints:
        df[col] = df[col].astype("Int64")
    return df


def _exported_steps(run: Run) -> pd.DataFrame:
    df = _masked(run, "SELECT step, time, duration_s, loss, loss_scale, skipped, grad_norm, lr, micro_batches,"
                      " nan_mask FROM steps ORDER BY step", STEP_NAN_BITS, ("micro_batches",))
    df["loss_scale"] = df["loss_scale"].astype(float)
    df["skipped"] = df["skipped"].astype(bool)
    return df


def _exported_layers(run: Run) -> pd.DataFrame:
    df = _masked(run, "SELECT l.step, t.name, l.grad_norm, l.grad_amax, l.param_norm, l.grad_nonfinite,"
                      " l.grad_zero_frac, l.nan_mask FROM layers l JOIN tensors t ON t.id = l.param_id"
                      " ORDER BY l.step, l.param_id", LAYER_NAN_BITS, ("grad_nonfinite",))
    df["grad_zero_frac"] = df["grad_zero_frac"].astype(float)
    return df


def _exported_events(run: Run) -> pd.DataFrame:
    df = run.events
    for col in ("fp32_amax", "lowp_amax"):  # NaN: the recompute gave NaN; None: none was done
        cells = list(df[col])
        df[col] = _nan_apart([math.nan if v is None else v for v in cells],
                             [v is not None and v != v for v in cells])
    return df


def _exported_metrics(run: Run) -> pd.DataFrame:
    df = run.metrics
    df["value"] = _nan_apart(df["value"], df["value"].isna())  # NULL is a logged NaN (see Run.exported)
    return df


_EXPORT: dict[str, Callable[[Run], pd.DataFrame]] = {
    "steps": _exported_steps, "layers": _exported_layers, "modules": lambda run: run.modules,
    "events": _exported_events, "metrics": _exported_metrics}
EXPORTED_TABLES = tuple(_EXPORT)


# Config keys that loops and frameworks use for the clip threshold (HF, nanoGPT, Lightning, others):
# only a fallback for runs where the clip_grad_norm_ call was not seen (older runs, FSDP1's own clip).
CLIP_CONFIG_KEYS = ("max_grad_norm", "grad_clip", "gradient_clip_val", "clip_grad_norm", "max_norm",
                    "clip_norm", "grad_norm_clip", "clip_grad")


def clip_threshold(info: dict[str, Any]) -> Optional[float]:
    """The run's clip ``max_norm``: as observed in the ``clip_grad_norm_`` call (``clip_max_norm``), else the first positive number under a known config key, else None."""
    observed = info.get("clip_max_norm")
    if isinstance(observed, (int, float)) and observed > 0:
        return float(observed)
    config = info.get("config") or {}
    for key in CLIP_CONFIG_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


# Event columns added after the first schema: older files lack them, and readers select NULL in
# their place (or leave them out).
EVENT_COLUMNS_ADDED = ("micro_batch", "fp32_amax", "fp32_nan", "flows_into", "lowp_amax", "lowp_nan")


def event_columns(conn: sqlite3.Connection, names: tuple = EVENT_COLUMNS_ADDED, missing_as_null: bool = True) -> str:
    """``", col, ..."`` to append to an events SELECT: each of ``names`` the file has, and for one it
    lacks ``NULL AS col`` (or nothing, with ``missing_as_null=False``)."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(events)")}
    return "".join(f", {c}" if c in have else (f", NULL AS {c}" if missing_as_null else "") for c in names)


def aliases_in(conn: sqlite3.Connection) -> dict[str, list[str]]:
    """Every name of a tied parameter or shared module -> its other names ({} for runs recorded
    before aliases were, schema < 3)."""
    cols = {r[1] for r in conn.execute("PRAGMA table_info(tensors)")}
    rows = conn.execute("SELECT name, aliases FROM tensors WHERE aliases IS NOT NULL").fetchall() \
        if "aliases" in cols else []
    return alias_map(rows)


def alias_map(rows: list[tuple[str, Optional[str]]]) -> dict[str, list[str]]:
    """(name, JSON list of other names) rows -> every name to its other names, both ways."""
    out: dict[str, list[str]] = {}
    for name, raw in rows:
        try:
            names = [name] + [str(n) for n in json.loads(raw or "[]")]
        except ValueError:
            continue
        for n in names:
            out[n] = [m for m in names if m != n]
    return out


def find_runs(folder: Any) -> list[Path]:
    """Run files directly inside ``folder`` (sorted), or RunError if it is not a folder of runs."""
    p = Path(path_text(folder, RunError, "the folder of runs", "runs"))
    if not p.exists():
        raise RunError(f"no folder at {str(p)!r}: check the path")
    if not p.is_dir():
        raise RunError(f"{str(p)!r} is not a folder: pass a folder of runs")
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in RUN_SUFFIXES)
    if not files:
        raise RunError(f"no runs in {str(p)!r}: expected .sqlite files written by ampwatch")
    return files


_RAW_BITS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def _numpy_dtype(name: str) -> np.dtype:
    """torch's dtype name -> numpy's, or the unsigned int of its width where numpy has none."""
    if name == "bool" or (name in np.sctypeDict and not name.startswith(("float8", "bfloat"))):
        return np.dtype(name)
    width = 1 if name.startswith("float8") else 2 if name in ("bfloat16", "uint16") else \
        int(''.join(c for c in name if c.isdigit()) or 8) // 8
    return np.dtype(_RAW_BITS.get(width, "uint8"))


def negative_inf_count(dtype: str, data: bytes) -> int:
    """How many of a saved input's values are -inf (an additive attention mask's legitimate
    value, unlike NaN or +inf)."""
    if dtype in ("float16", "float32", "float64"):
        return int(np.isneginf(np.frombuffer(data, dtype=dtype)).sum())
    if dtype == "bfloat16":
        return int((np.frombuffer(data, dtype=np.uint16) == 0xFF80).sum())
    return 0


def nonfinite_counts(dtype: str, data: bytes) -> Optional[tuple[int, int, int]]:
    """(NaN count, inf count, elements) of a saved input's bytes (the ``batches`` table); None for
    a dtype that holds neither (integers, bool) or one read here only as bits it does not know
    (float8)."""
    if dtype in ("float16", "float32", "float64"):
        values = np.frombuffer(data, dtype=dtype)
        return int(np.isnan(values).sum()), int(np.isinf(values).sum()), int(values.size)
    if dtype == "bfloat16":  # float32's upper half: exponent 0xFF is inf (mantissa 0) or NaN
        bits = np.frombuffer(data, dtype=np.uint16)
        top = (bits & 0x7F80) == 0x7F80
        nan = top & ((bits & 0x7F) != 0)
        return int(nan.sum()), int((top & ~nan).sum()), int(bits.size)
    return None


_STEP_IN_NAME = re.compile(r"""\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\["((?:[^"\\]|\\.)*)"\]""")


def call_from_names(values: dict[str, Any], where: str) -> tuple[tuple, dict]:
    """``(args, kwargs)`` rebuilt from saved inputs named as the recorder names them (``args[0]``,
    ``kwargs['batch']['ids']``, ``args[1][0]``: record/batches.py), for ``model(*args, **kwargs)``.
    Lists stand for the tuples and lists the call held. A position the recorder did not save (not a
    tensor) cannot be filled: :class:`RunError` naming it (``where``: the run and step, for it)."""
    root: dict[str, Any] = {"args": {}, "kwargs": {}}
    for name, value in values.items():
        head, _, rest = name.partition("[")
        if head not in root:
            raise RunError(f"saved input {name!r} of {where} is not named args[...] or kwargs[...]")
        keys = []
        for index, single, double in _STEP_IN_NAME.findall("[" + rest if rest else ""):
            key = single or double  # repr's quoting: no eval, its three escapes undone
            keys.append(int(index) if index else key.replace("\\'", "'").replace('\\"', '"').replace("\\\\", "\\"))
        node: Any = root[head]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if keys:
            node[keys[-1]] = value
    def build(node: Any, label: str) -> Any:
        if not isinstance(node, dict) or not node:
            return node
        if all(isinstance(k, int) for k in node):
            missing = sorted(set(range(max(node) + 1)) - set(node))
            if missing:
                raise RunError(f"{label}[{missing[0]}] of {where} was not saved (not a tensor): the call cannot be "
                               "rebuilt; use the tensors by name (ampwatch.load_batch without call=True)")
            return [build(node[i], f"{label}[{i}]") for i in range(len(node))]
        return {k: build(v, f"{label}[{k!r}]") for k, v in node.items()}
    args = build(root["args"], "args") or []
    return tuple(args), build(root["kwargs"], "kwargs") or {}
