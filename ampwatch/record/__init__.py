"""The recording side: the only torch-heavy, hot-path code.

watch.py (Watch: attach/log/close, step moments) · scaler.py (GradScaler hooks) · grads.py
(gradient norms and detail) · observe.py (module observation: static slots, one stats buffer, the
``ampwatch::observe`` op) · step.py (one flat tensor and one transfer per step) · packing.py and
origins.py (the writer thread's side: rows and origin analysis).
"""
