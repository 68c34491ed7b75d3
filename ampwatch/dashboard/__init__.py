"""The dashboard's data and figures, for the Streamlit app in ``app/``: read-only queries over one run
(:mod:`.rundata`), per-layer and per-module data (:mod:`.layerdata`), a job's ranks (:mod:`.ranks`),
and pure Plotly builders (:mod:`.figures`). No Streamlit and no torch here."""
