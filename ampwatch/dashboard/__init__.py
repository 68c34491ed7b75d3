"""The dashboard's data and figures, for the Streamlit app in ``app/``: read-only queries over one run
(:mod:`.rundata`), per-layer and per-module data (:mod:`.layerdata`), a job's ranks (:mod:`.ranks`),
and pure Plotly builders (:mod:`.figures`); :mod:`.launch` starts the app for ``ampwatch dashboard``
(the wheel ships ``app/`` here, as ``dashboard/app/``). No Streamlit and no torch here."""
