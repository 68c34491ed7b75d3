"""The run file: its schema as code (:mod:`.schema`), the only writer (:mod:`.writer`, a background
thread that takes :class:`.rows.Rows` and knows no torch), the read-only reader (:mod:`.reader`) and
the guard that turns any failure reading a damaged file into one clear line (:mod:`.guard`)."""
