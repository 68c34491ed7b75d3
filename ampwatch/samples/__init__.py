"""Sample runs: the demo model (:mod:`.models`) and the generator of ``sample_runs/`` (:mod:`.demo`,
:mod:`.lightning_sample`). Not library code: only ``ampwatch demo`` and the tests use it."""
