"""The slots of module observation: each observed module call has ROLES slots in the stats buffer,
one per role below, and each slot keeps its min/max per dtype in DTYPE_NAMES' order.

Plain constants with no torch import, shared by the hooks that fill the slots (:mod:`.observe`) and
the writer thread's analysis that reads them back (:mod:`.origins`, :mod:`.packing`).
"""
IN, OUT, GIN, GOUT = range(4)  # module input, output, input gradient, output gradient
ROLES = 4
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16")
FORWARD, BACKWARD = "forward", "backward"
# the model's own input (the root module's IN slot): NaN/+inf there came with the batch
INPUT = "input"
