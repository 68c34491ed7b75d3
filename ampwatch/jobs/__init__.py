"""Several rank files of one distributed job read as one: :func:`.group.load_group` and
:class:`.group.RunGroup` (which files belong together), :mod:`.combine` (the arithmetic across ranks:
the global gradient norm, skip agreement, the first NaN/Inf of the job). Reading only; no torch."""
