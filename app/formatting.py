"""Numbers and findings as short text for the pages, and a shown table as a CSV download."""
from __future__ import annotations

import math
from typing import Any

import pandas as pd
import streamlit as st

SEVERITY_ICON = {"error": ":material/error:", "warning": ":material/warning:", "info": ":material/info:"}
SEVERITY_BADGE = {"error": ":red-badge[:material/error: ERROR]", "warning": ":orange-badge[:material/warning: WARNING]",
                  "info": ":blue-badge[:material/info: INFO]"}


def fmt(x: Any, spec: str = "{:.4g}", nan: str = "NaN") -> str:
    """A number for display: NaN stays visibly 'NaN' (st.dataframe shows NaN as 'None'); None is '–'."""
    if x is None:
        return "–"
    if isinstance(x, float) and math.isnan(x):
        return nan
    return spec.format(x)


def fmt_scale(x: Any) -> str:
    """A loss scale short enough for a headline: 65536 as is, 2^-53 for tiny or huge powers of two."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return fmt(x)
    if 1 <= x < 1e7:
        return f"{x:g}"
    m, e = math.frexp(float(x))
    return f"2^{e - 1}" if m == 0.5 else f"{x:.2g}"


def step_span(first: int, last: int) -> str:
    """'step 175' for one step (not 'steps 175–175'), else 'steps 120–149'."""
    return f"step {first}" if first == last else f"steps {first}–{last}"


def readable(df: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """A copy for display with ``columns`` (name -> text for NaN) as text: NaN and 'not recorded' differ."""
    out = df.copy()
    for col, nan in columns.items():
        out[col] = [fmt(v, nan=nan) for v in out[col].astype(object)]
    return out


MISSING = "–"  # a value not recorded: what every other column writes for it, not Streamlit's 'None'


def table(df: pd.DataFrame, **kwargs: Any) -> Any:
    """``st.dataframe`` with missing cells shown as '–' (Streamlit's own placeholder is 'None'), so
    number columns can stay numbers and sort as numbers. A NaN that means something (a NaN loss)
    must be made text first (:func:`readable`): the placeholder covers NaN too."""
    return st.dataframe(df, placeholder=MISSING, **kwargs)


# The runs table's column headers, shared by every page that shows its columns (Runs, Compare).
RUN_COLUMNS = {"skipped_pct": st.column_config.NumberColumn("skipped %", format="%.1f"),
               "final_scale": "final loss scale", "last_loss": "last loss",
               "health": st.column_config.TextColumn(
                   "health", help="the doctor's worst severity and first root cause; ok: nothing above info"),
               # a number, so it sorts as one; none shows as '–' (``table``'s placeholder)
               "first_nonfinite_step": st.column_config.NumberColumn("first NaN/inf step", format="%d",
                                                                     help="after the scaler's warm-up; – for none"),
               "started": st.column_config.DatetimeColumn("started (UTC)")}


def runs_for_display(df: pd.DataFrame) -> pd.DataFrame:
    """A runs table for display: the final loss scale as the overview's headline writes it (65536,
    2^-53), not 6.554e+04, and '–' without a scaler; a NaN last loss stays 'NaN', none logged is '–';
    the first NaN/inf step a nullable integer (shown '–' by :func:`table` where nothing went
    non-finite; as text it sorted 180 before 25)."""
    out = readable(df, {"last_loss": "NaN"})
    out["final_scale"] = ["–" if v is None or v != v else fmt_scale(v)  # NULL (no scaler) reads NaN in pandas
                          for v in out["final_scale"].astype(object)]
    if "first_nonfinite_step" in out:
        out["first_nonfinite_step"] = steps_column(out["first_nonfinite_step"])
    return out


def steps_column(values: pd.Series) -> pd.Series:
    """Step numbers as pandas' nullable integers: a column of ints and None is float in pandas, whose
    missing values a table shows as NaN or 'None'."""
    return pd.Series(pd.array([None if v is None or v != v else int(v) for v in values.astype(object)],
                              dtype="Int64"), index=values.index)


def download(df: pd.DataFrame, name: str, label: str = "Download CSV") -> None:
    st.download_button(label, df.to_csv(index=False).encode(), file_name=name, mime="text/csv",
                       key=f"dl:{name}")
