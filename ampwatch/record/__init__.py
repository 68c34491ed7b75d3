"""Everything that runs inside training: the only torch-heavy, hot-path code.

watch.py (Watch: attach/log/close, step moments) · options.py (attach's options, one table) ·
runinfo.py (what a run is, gathered at attach) · scaler.py (GradScaler hooks) · clipping.py (the
clip threshold and the clip's own gradient norms) · compiled.py (torch.compile and the hooks) ·
grads.py (gradient norms and detail) · observe.py and slots.py (module observation: static slots,
one stats buffer, maxima traced into compiled graphs, the ``ampwatch::observe`` and
``ampwatch::keep_max`` ops) · traced_aliases.py (a compiled observed forward observes each
tensor once, as eager does) · backward.py
(when a backward pass ends) · replay.py (localizing a skipped step by replaying it) · batches.py
(a bad step's inputs, saved to run it again) ·
skipflag.py and deferred.py (a fused step's skip, read late) · kernelskip.py (a bf16 step's check
as a fused optimizer's skip flag) · keptweights.py (a bf16 step's weights, kept for a late check) ·
recompute.py (the fp32 counterfactual) · step.py (one flat tensor and one transfer per step) ·
packing.py, origins.py and healthy.py (the writer thread's side: rows, origin analysis, a
healthy step's module rows) · torch_access.py
(the one place that reads torch objects' state, private attributes included, with public
fallbacks).
"""
