"""The run file's schema, as code. Migrations are only ever appended, never edited.

``PRAGMA user_version`` holds :data:`SCHEMA_VERSION`; readers refuse files from a newer ampwatch.
Documented for humans in ``docs/schema.md``.
"""
from __future__ import annotations

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

SCHEMA_VERSION = 8  # the number of migrations below; readers accept any version up to it

# SQLite stores a float NaN as NULL. Columns that may legitimately hold NaN get a bit in the row's
# ``nan_mask`` so readers can tell "NaN" from "not measured" (see docs/schema.md).
STEP_NAN_BITS = {"loss": 1, "grad_norm": 2}
LAYER_NAN_BITS = {"grad_norm": 1, "grad_amax": 2, "param_norm": 4}
MODULE_PHASES = ("forward", "backward")

migrations = Migrations("ampwatch")


@migrations()
def m001_initial(db: Database) -> None:
    db.executescript(
        """
        CREATE TABLE run (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            name TEXT NOT NULL,
            status TEXT NOT NULL,          -- running | finished | crashed
            started_at REAL NOT NULL,      -- unix seconds
            ended_at REAL,
            heartbeat_at REAL,             -- last writer flush; stale + running => interrupted
            pid INTEGER,
            hostname TEXT,
            error TEXT,                    -- traceback text when crashed
            torch_version TEXT,
            ampwatch_version TEXT,
            device TEXT,
            amp_dtype TEXT,
            scaler_enabled INTEGER,
            init_scale REAL,
            growth_factor REAL,
            backoff_factor REAL,
            growth_interval INTEGER,
            optimizer TEXT,
            param_count INTEGER,
            rank INTEGER,
            world_size INTEGER,
            framework TEXT,
            layer_every INTEGER,
            localize INTEGER,
            config_json TEXT,
            schema_version INTEGER
        );
        CREATE TABLE tensors (               -- names of parameters and modules, stored once
            id INTEGER PRIMARY KEY,
            kind TEXT NOT NULL,              -- param | module
            name TEXT NOT NULL,
            type TEXT,                       -- module class, or parameter dtype
            shape TEXT,
            numel INTEGER,
            trainable INTEGER
        );
        CREATE TABLE steps (
            step INTEGER PRIMARY KEY,        -- 0-based optimizer step attempted
            time REAL,                       -- unix seconds at step end
            duration_s REAL,
            loss REAL,                       -- unscaled mean over micro-batches
            loss_scale REAL,                 -- NULL without an enabled scaler
            skipped INTEGER NOT NULL,
            grad_norm REAL,                  -- unscaled, before clipping
            lr REAL,
            micro_batches INTEGER,
            nan_mask INTEGER NOT NULL DEFAULT 0
        );
        CREATE TABLE layers (
            param_id INTEGER NOT NULL,
            step INTEGER NOT NULL,
            grad_norm REAL,
            grad_amax REAL,
            param_norm REAL,
            grad_nonfinite INTEGER,
            grad_zero_frac REAL,
            nan_mask INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (step, param_id)   -- step-major: appends stay at the B-tree's end (2x faster)
        ) WITHOUT ROWID;
        CREATE TABLE modules (
            module_id INTEGER NOT NULL,
            phase INTEGER NOT NULL,          -- 0 forward (activation), 1 backward (grad w.r.t. input)
            step INTEGER NOT NULL,
            amax REAL,                       -- max |value| (backward: scaled, as it overflows)
            nonfinite INTEGER NOT NULL,
            PRIMARY KEY (step, module_id, phase)
        ) WITHOUT ROWID;
        CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            step INTEGER NOT NULL,
            phase TEXT NOT NULL,             -- forward | backward | param_grad | loss | input (what the model was fed)
            module TEXT NOT NULL,
            kind TEXT NOT NULL,              -- nan | inf | nan+inf
            count INTEGER,                   -- non-finite elements (NULL when not counted)
            amax REAL,
            dtype TEXT,
            origin INTEGER NOT NULL
        );
        CREATE INDEX events_step ON events(step);
        CREATE TABLE metrics (
            key TEXT NOT NULL,
            step INTEGER NOT NULL,
            value REAL,
            PRIMARY KEY (key, step)
        ) WITHOUT ROWID;
        CREATE TABLE notices (               -- misuse the recorder saw (e.g. step() without update())
            step INTEGER,
            code TEXT NOT NULL,
            message TEXT NOT NULL
        );
        """
    )


@migrations()
def m002_ranks(db: Database) -> None:
    """What a reader needs to put the ranks of one job back together (docs/schema.md)."""
    db.executescript(
        """
        ALTER TABLE run ADD COLUMN job_id TEXT;         -- same for every rank of one job; NULL single-process
        ALTER TABLE run ADD COLUMN grad_sharding TEXT;  -- sharded (FSDP) | replicated (DDP) | none
        ALTER TABLE events ADD COLUMN micro_batch INTEGER;  -- 0-based micro-batch of the step (forward)
        """
    )


@migrations()
def m003_fp32_counterfactual(db: Database) -> None:
    """The fp32 recompute of a forward origin, and where a container's own non-finite value went."""
    db.executescript(
        """
        ALTER TABLE events ADD COLUMN fp32_amax REAL;     -- forward origins: max |output| recomputed in fp32
        ALTER TABLE events ADD COLUMN fp32_nan INTEGER;   -- 1: that recompute gave NaN (stored NULL above)
        ALTER TABLE events ADD COLUMN flows_into TEXT;    -- origin in a container's own code: the child
                                                          -- the non-finite value (or gradient) went into
        """
    )


@migrations()
def m004_faithful_loops(db: Database) -> None:
    """Schema 4: the loss definition a run used, tied-parameter names and the observed clip threshold."""
    db.executescript(
        """
        ALTER TABLE run ADD COLUMN loss_definition TEXT;  -- scaled-sum | logged-mean; NULL: older runs (mean)
        ALTER TABLE run ADD COLUMN clip_max_norm REAL;    -- max_norm of the last clip_grad_norm_ call seen
        ALTER TABLE tensors ADD COLUMN aliases TEXT;      -- JSON list of the tensor's other names (tied weights)
        """
    )


@migrations()
def m005_low_precision_rerun(db: Database) -> None:
    """The forward origin re-run in its own dtypes when the fp32 recompute came back finite."""
    db.executescript(
        """
        ALTER TABLE events ADD COLUMN lowp_amax REAL;     -- forward origins whose fp32 recompute was finite:
                                                          -- max |output| re-run in the call's own dtypes
        ALTER TABLE events ADD COLUMN lowp_nan INTEGER;   -- 1: that re-run gave NaN (stored NULL above)
        """
    )


@migrations()
def m006_fp8(db: Database) -> None:
    """FP8 training: the run's fp8 recipe, and what each fp8 layer's casts lose on layer_every steps."""
    db.executescript(
        """
        ALTER TABLE run ADD COLUMN fp8_recipe TEXT;     -- tensorwise | rowwise | rowwise_with_gw_hp | custom | mixed
        ALTER TABLE run ADD COLUMN fp8_casts TEXT;      -- JSON: role -> "e4m3 tensorwise" ...
        ALTER TABLE run ADD COLUMN fp8_layers INTEGER;  -- number of fp8 layers found at attach
        CREATE TABLE fp8_layers (
            step INTEGER NOT NULL,
            module TEXT NOT NULL,            -- the fp8 layer's qualified name
            role TEXT NOT NULL,              -- input | weight | grad_output | ..._for_grad_* | output
            dtype TEXT,                      -- e4m3 | e5m2 (NULL for output)
            scaling TEXT,                    -- tensorwise | rowwise (NULL for output)
            amax REAL,                       -- max |value| (output: of the high-precision output)
            scale REAL,                      -- the scale the recipe derives (rowwise: the smallest)
            p99 REAL,                        -- 99th percentile of |value|
            flush_frac REAL,                 -- nonzero values the cast makes 0, over nonzero values
            sat_frac REAL,                   -- values beyond the fp8 maximum, over all values
            rel_err REAL,                    -- output only: ||fp8 output - high precision|| / ||high precision||
            numel INTEGER,
            nonfinite INTEGER,               -- NaN/inf elements in the tensor
            PRIMARY KEY (step, module, role)
        ) WITHOUT ROWID;
        """
    )


@migrations()
def m007_memory(db: Database) -> None:
    """The process's memory, read by the writer thread at each commit that holds new steps."""
    db.executescript(
        """
        CREATE TABLE memory (
            step INTEGER PRIMARY KEY,        -- the last step of the commit it was read at
            host_rss REAL,                   -- bytes resident (Linux; NULL elsewhere)
            device_allocated REAL,           -- bytes in tensors, CUDA caching allocator (NULL off CUDA)
            device_reserved REAL             -- bytes the allocator holds (NULL off CUDA)
        );
        """
    )


@migrations()
def m008_batches(db: Database) -> None:
    """The model's inputs of the first steps whose loss or outputs went NaN/Inf (record/batches.py)."""
    db.executescript(
        """
        CREATE TABLE batches (
            step INTEGER NOT NULL,
            micro_batch INTEGER NOT NULL,    -- 0-based forward of the root within the step
            name TEXT NOT NULL,              -- where in the call: args[0], kwargs['input_ids'], ...
            dtype TEXT NOT NULL,             -- torch's name without 'torch.': int64, float16, bfloat16, ...
            shape TEXT NOT NULL,             -- JSON list
            nbytes INTEGER NOT NULL,
            sha256 TEXT,                     -- of data; NULL when not saved (over the budget)
            data BLOB,                       -- the elements, C order, native byte order; NULL when not saved
            PRIMARY KEY (step, micro_batch, name)
        ) WITHOUT ROWID;
        """
    )


def create(db: Database) -> None:
    """Create or upgrade a run file's tables (writer only; readers never migrate)."""
    migrations.apply(db)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

# In SQL, abs(x) > INF_BOUND  <=>  x is +/-inf (SQLite has no isinf(); the bound is the largest double).
INF_BOUND = 1.7976931348623157e308
