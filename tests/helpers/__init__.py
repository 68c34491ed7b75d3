"""What the tests share: tiny models and loops (loops), ground truth read with plain sqlite3 (sqltruth),
synthetic rank files of a job (synthetic_job), a free port for gloo (ports), a W&B offline run read
back (wandb_offline), and the worker scripts the distributed and integration tests start in their own
processes (*_worker.py)."""
