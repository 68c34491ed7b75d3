"""Run by test_group.py as one process per rank: 2 DDP ranks (gloo, CPU), each attached to ampwatch.
Rank ``DYING_RANK`` kills itself with SIGKILL in the middle of step ``DEATH_STEP`` (as the OOM killer
would); the other rank's next all-reduce then fails, and it ends with that exception."""
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

DEATH_STEP, DYING_RANK, WORLD = 6, 1, 2


def main(rank: int, out: str, port: str) -> None:
    import ampwatch
    from loops import amp_step, data, mlp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with ampwatch.attach(model, opt, scaler, path=os.path.join(out, "job.sqlite"), flush_every_s=0.05):
        for i in range(DEATH_STEP + 20):
            if i == DEATH_STEP and rank == DYING_RANK:
                time.sleep(0.5)  # the writer flushes every completed step first
                os.kill(os.getpid(), signal.SIGKILL)
            amp_step(model, opt, scaler, *data(i * WORLD + rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
