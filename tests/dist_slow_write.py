"""Run by tests/test_train_seq.py under torchrun: `python tests/dist_slow_write.py SECONDS train_seq.py-flags...` runs
train_seq.main with every directory that rank 0 writes atomically (checkpoints, pools, adapters) taking SECONDS longer,
as an 8B checkpoint's write takes about a minute. A rank that reads what rank 0 writes before rank 0 has written it
(the next stage loading its parent) fails."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_seq  # noqa: E402
from acl import common  # noqa: E402

real = common.write_atomically


def slow(out_dir, write):
    if common.rank() == 0:
        time.sleep(float(sys.argv[1]))
    return real(out_dir, write)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    common.write_atomically = slow
    train_seq.main(sys.argv[2:])
