"""Plumbing shared by every script, and nothing else: processes (torchrun init/teardown, collectives, print0,
seeding), FSDP2 (sharding, full state dicts, parameters gathered one at a time), files (written atomically;
checkpoints with their acl_meta.json; the resume state), loading a policy, and safetensors read tensor by tensor.
The training step that every method runs is acl/step.py; the rollout engines are acl/engine.py and acl/vllm.py.

Under torchrun (WORLD_SIZE set) init_dist() starts NCCL for CUDA tensors and gloo for CPU ones on GPUs, gloo on CPUs;
on one GPU without torchrun a one-rank group (so bf16 mixed precision applies); otherwise it is a single process and
every collective below is a no-op.
"""
import argparse
import contextlib
import glob
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from acl.compiled import compile_layers
from envs.base import UsageError, fsync, tmp_tag, write_file_atomically


def usage_exit(e):
    """The one way a script stops on bad input: one line on stderr, exit status 2 (argparse's own)."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """argparse with the project's manners: a usage error is one line and exit status 2, and a negative number
    right after a flag (`--lr -1e-3`, which argparse takes for a flag) is that flag's value, as in `--lr=-1e-3`."""

    def error(self, message):
        usage_exit(message)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        joined = []
        for tok in args:
            if joined and NEGATIVE_NUMBER.match(tok) and joined[-1].startswith("--") and "=" not in joined[-1]:
                joined[-1] = f"{joined[-1]}={tok}"
            else:
                joined.append(tok)
        return super().parse_known_args(joined, namespace)


def preset_parser(presets: dict, doc: str, argv=None) -> tuple:
    """A training script's parser, --preset first (its value picks every other flag's default), then --runs.
    -> (parser, preset name, that preset's defaults)."""
    pre = Parser(add_help=False)
    pre.add_argument("--preset", default="tiny", choices=sorted(presets))
    name = pre.parse_known_args(argv)[0].preset
    p = Parser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(presets), help="defaults for every flag below")
    p.add_argument("--runs", default=None, help="run directory (default runs/<preset>)")
    return p, name, presets[name]


def check_output(path: str, kind: str, inputs=(), overwrite: bool = False, flag: str = "--out") -> str:
    """The one rule for where a script writes a checkpoint of `kind` (acl_meta.json's "method"): the target may be
    replaced only if it is a checkpoint of that kind that this project wrote and `overwrite` is set (a script's
    own resume logic decides for itself); never if it is an input of the same command, the current directory or
    one of its parents, a file, or a directory holding anything else. UsageError before any work; -> abspath."""
    target = os.path.realpath(path)
    where = check_writable(path, flag)
    for other in inputs:
        o = os.path.realpath(other)
        if o == target or o.startswith(target + os.sep) or target.startswith(o + os.sep):
            raise UsageError(f"{flag} {path} is (or holds, or lies in) {other}, an input of this command")
    if os.path.isdir(target) and os.listdir(target):
        meta = read_meta(target)
        if not meta:
            raise UsageError(f"{flag} {path} is a directory that this project did not write (no acl_meta.json): "
                             f"refusing to replace it")
        if meta.get("method") != kind:
            raise UsageError(f"{flag} {path} holds a {meta.get('method')!r} checkpoint, not a {kind!r} one: "
                             f"refusing to replace it")
        if not overwrite:
            raise UsageError(f"{flag} {path} holds a {kind} checkpoint already (saved {meta.get('saved_at', '?')}); "
                             f"pass --overwrite to replace it")
    return where


def check_writable(path: str, flag: str) -> str:
    """UsageError unless `path` can be a directory this script writes into: not a file, not the current directory
    or one of its parents, and under a directory that exists and is writable (or can be made). -> abspath."""
    target = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if target == cwd or cwd.startswith(target + os.sep):
        raise UsageError(f"{flag} {path} is the current directory or one of its parents")
    if os.path.lexists(target) and not os.path.isdir(target):
        raise UsageError(f"{flag} {path} is a file, not a directory")
    up = target
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up) or not os.access(up, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write under {up}")
    return os.path.abspath(path)


# ----------------------------------------------------------------------------- processes


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def sharded() -> bool:
    """True when a process group is up, so models are FSDP2-sharded (under torchrun, even with one rank:
    that is how one GPU gets FSDP2's bf16 MixedPrecisionPolicy)."""
    return dist.is_available() and dist.is_initialized()


def dist_backend(cuda: bool) -> str:
    """The process group's backend for each device type. On GPUs NCCL serves CUDA tensors and gloo the CPU ones: the
    scalars the collective helpers below reduce, object collectives, DCP's plans; NCCL alone refuses a CPU tensor
    ("No backend type associated with device type cpu"), which stopped every GPU run at its first update. gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_dist(timeout_minutes: float | None = None, bf16: bool = False):
    """-> torch.device for this rank. Starts the process group (dist_backend) under torchrun, with a timeout for every
    collective of `timeout_minutes` (--dist-timeout; torch's default is 10 minutes for NCCL, which an 8B evaluation on
    rank 0 outlasts while the other ranks wait at a barrier). On a GPU without torchrun (`python train_seq.py` on one
    GPU) it starts a one-rank group itself, so that shard() applies FSDP2's bf16 MixedPrecisionPolicy exactly as under
    torchrun (without a group the model would train in fp32 at a third of the speed, and silently). Prints one line:
    the ranks, the device and the precision."""
    import datetime
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    kw = {"timeout": datetime.timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(dist_backend(cuda), **kw)
        elif cuda:   # one GPU, no torchrun: a one-rank group through a file store (no port, no network)
            import tempfile
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="acl-pg-"), "store"), 1)
            dist.init_process_group(dist_backend(cuda), store=store, rank=0, world_size=1, **kw)
    mp = "bf16 compute, fp32 master weights and gradient reduction (FSDP2 MixedPrecisionPolicy)" if bf16 and sharded() \
        else "fp32" + (" (--bf16 needs a process group: torchrun, or a GPU)" if bf16 else "")
    print0(f"{world_size()} rank(s) on {device.type}{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}: "
           f"{mp}")
    return device


def teardown(status: int = 0):
    """Barrier, then destroy the process group (gloo aborts at exit without the barrier). Under a group the process
    then exits at once with `status`: on CPU, gloo's worker threads can still abort a finished rank during
    interpreter shutdown ("terminate called without an active exception", about 1 run in 4 after an FSDP2 update),
    which would fail a run whose work is all done and saved. Without a group it returns."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# Collectives: a Python number in, a Python float out (the same on every rank); the number itself when not
# distributed.
def _all_reduce(x: float, op) -> float:
    if not sharded():
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def all_reduce_sum(x: float) -> float:
    return _all_reduce(x, dist.ReduceOp.SUM)


def all_reduce_max(x: float) -> float:
    return _all_reduce(x, dist.ReduceOp.MAX)


def gather_mean(values) -> float:
    """Mean of a list of numbers over all ranks' lists."""
    return all_reduce_sum(sum(values)) / max(all_reduce_sum(len(values)), 1.0)


def print0(*args, **kwargs):
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def eta(t0: float, done: int, left: int, at_most: bool = False) -> str:
    """The end of a progress line: seconds since t0 and, if the `left` units cost what the `done` ones did, to go
    (at_most: the loop may stop early, so the ETA is an upper bound)."""
    el = time.time() - t0
    return f"{el:.0f}s elapsed, ETA {'<=' if at_most else ''}{el / max(done, 1) * left:.0f}s"


# ----------------------------------------------------------------------------- FSDP2

def shard(model, bf16: bool = False, cpu_offload: bool = False, compiled: bool = False):
    """FSDP2: fully_shard every decoder layer, then the root (a peft model's too: a layer's frozen weights and its
    LoRA weights share one shard group; only the trainable ones get gradients). With bf16, parameters are cast to
    bf16 for compute and gradients reduced in fp32 (MixedPrecisionPolicy); cpu_offload keeps shards on the CPU.
    A no-op without a process group, so the same training loop runs unsharded on a laptop. compiled (--compile):
    acl.compiled.compile_layers first, with or without a group."""
    if compiled:
        compile_layers(model)
    if not sharded():
        return model
    kw = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model   # a peft model wraps it
    for layer in inner.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def shard_device(device):
    """Where to load a model that shard() then shards: the CPU under a process group (fully_shard moves each layer's
    states to the rank's device as it shards them, so a GPU never holds a whole fp32 copy of an 8B policy beside an
    awake engine: ~33 GB more at the load, each rank's host memory holding it instead), else `device`."""
    return torch.device("cpu") if sharded() else device


def full_state_dict(model) -> dict:
    """The whole model's state dict on rank 0 (on the CPU), {} on other ranks; plain state_dict() when
    unsharded. Every rank must call it: the gather is a collective."""
    if not sharded():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_params(model, trainable_only: bool = False):
    """Yield (name, full tensor) for every parameter (that requires a gradient, with trainable_only), one at a time:
    under FSDP2 each is all-gathered as it is yielded (every rank must iterate in step), so weights can be pushed to
    a generation engine without ever holding a whole unsharded model beside the shards."""
    for name, p in model.named_parameters():
        if p.requires_grad or not trainable_only:
            yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


# ----------------------------------------------------------------------------- files and checkpoints


def save_json(path: str, obj) -> str:
    """obj as indented JSON, written atomically."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, default=str)
    return write_file_atomically(path, write)


def pyplot():
    """matplotlib's pyplot on its file-only backend (no display needed): every plot of the project goes to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path):
    """Write a matplotlib figure as a PNG atomically and close it; returns path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    write_file_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120), suffix=".png")
    plt.close(fig)
    return path


def run_name(ckpt) -> tuple:
    """(eval directory, name) of a checkpoint: runs/tiny/seq/1-math -> (runs/tiny/eval, seq-1-math);
    (None, basename) when the path is not under runs/<preset>/."""
    parts = os.path.abspath(ckpt).split(os.sep)
    for i in range(len(parts) - 3, -1, -1):  # the last `runs` with a preset and a checkpoint below it
        if parts[i] == "runs":
            return os.sep.join(parts[: i + 2] + ["eval"]), "-".join(parts[i + 2:])
    return None, parts[-1]


def is_checkpoint(path: str) -> bool:
    """A Hugging Face model directory (config.json in it)."""
    return os.path.isfile(os.path.join(path, "config.json"))


# ----------------------------------------------------------------------------- a run's own files
# Beside a checkpoint directory OUT that a run is making: .resume-OUT/ (the state to resume from, a
# torch.distributed.checkpoint directory), .resume-OUT.json (the recipe that made it, written first) and
# .diverged-OUT.json (a run that stopped on non-finite numbers).

def run_files(out: str) -> tuple:
    """(resume state, its recipe, divergence marker) of the checkpoint directory `out`."""
    d, b = os.path.dirname(os.path.abspath(out)), os.path.basename(os.path.abspath(out))
    state = os.path.join(d, f".resume-{b}")
    return state, recipe_file(state), os.path.join(d, f".diverged-{b}.json")


def recipe_file(state: str) -> str:
    """Where the recipe of the resume state `state` is kept: .resume-OUT -> .resume-OUT.json."""
    return state + ".json"


def check_run_files(out: str, recipe: dict, also=(), replace: bool = False):
    """UsageError unless what lies in out's place belongs to a run with `recipe`: the finished checkpoint (and the
    ones in `also`; with `replace`, a finished `out` of another recipe is let through, to be replaced), a resume
    state, and no divergence marker (a run that diverged is not continued)."""
    state, state_recipe, diverged = run_files(out)
    if os.path.isfile(diverged):
        with open(diverged) as f:
            why = json.load(f).get("reason")
        raise UsageError(f"{out} diverged in an earlier run ({why}); change the recipe under another --runs, or "
                         f"delete {diverged} to try again")
    for path in [*([] if replace else [out]), *also]:
        meta = read_meta(path)
        if meta and meta.get("recipe") != recipe:
            raise UsageError(f"{path} was made with another recipe or from another parent; use another --runs or "
                             f"delete it")
    if os.path.isdir(state):
        saved = json.load(open(state_recipe)) if os.path.isfile(state_recipe) else None
        if saved != recipe:
            raise UsageError(f"{state} was saved by a run with another recipe or parent; use another --runs or "
                             f"delete it")


def mark_diverged(out: str, reason: str):
    save_json(run_files(out)[2], dict(reason=reason, at=time.strftime("%Y-%m-%dT%H:%M:%S")))


def remove_leftovers(outs: list, files=()):
    """Remove what killed writes leave and nothing else would: the temporary directories and files of the
    checkpoints `outs` (.tmp-<name>-<host>-<pid>-...), of their resume states, recipes, divergence markers and metrics
    logs, and of the files `files` (<file>.tmp-<host>-<pid>); only the names of these outputs (a name's glob characters
    taken literally), and only where the writer's process is gone (tmp_tag)."""
    import glob
    host, finals = socket.gethostname(), list(files)
    for out in outs:
        finals += [out, *run_files(out), os.path.abspath(out) + ".metrics.jsonl"]
    for f in finals:
        d, b = os.path.split(os.path.abspath(f))
        for prefix in (os.path.join(d, f".tmp-{b}-{host}-"), os.path.join(d, f"{b}.tmp-{host}-")):
            for path in glob.glob(glob.escape(prefix) + "*"):
                pid = re.match(r"\d+", path[len(prefix):])
                if pid and int(pid.group()) != os.getpid() and not _alive(int(pid.group())):
                    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
                    print0(f"removed {path}, left by a killed run")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


class Metrics:
    """The per-step metrics of the run that makes checkpoint directory `out`, one JSON line per step in
    <out>.metrics.jsonl beside it (runs/tiny/seq/1-math.metrics.jsonl), written by rank 0 and flushed at once. Made
    with the step the run resumes from: the rows after it (the killed attempt's last steps) are dropped, so a resumed
    run holds each step exactly once; a run from step 0 starts the file afresh.
    wandb: a Weights & Biases project (--wandb) that gets the same rows: one W&B run per checkpoint, its id derived
    from `out` so that a resumed run continues it; offline (synced later with `wandb sync`) unless WANDB_API_KEY or
    WANDB_MODE is set. An optional import (check_wandb refuses the flag before any work when it is missing)."""

    def __init__(self, out: str, resume_step: int = 0, wandb: str | None = None, config: dict | None = None):
        self.path = os.path.abspath(out) + ".metrics.jsonl"
        self.wb = None
        if rank() != 0:
            return
        rows = []
        if resume_step and os.path.isfile(self.path):
            with open(self.path) as f:
                rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        def write(tmp):
            with open(tmp, "w") as f:
                f.writelines(rows)
        write_file_atomically(self.path, write)
        if wandb:
            import hashlib

            import wandb as wb
            if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
                os.environ["WANDB_MODE"] = "offline"
            run_id = hashlib.sha256(os.path.abspath(out).encode()).hexdigest()[:16]
            self.wb = wb.init(project=wandb, id=run_id, resume="allow", name=os.path.relpath(out),
                              group=os.path.dirname(os.path.abspath(out)), dir=os.path.dirname(os.path.abspath(out)),
                              config=json.loads(json.dumps(config or {}, default=str)))

    def log(self, row: dict):
        if rank() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(row, time=round(time.time(), 1)), default=float) + "\n")
            if self.wb is not None:
                def flat(d, pre=""):   # numbers only; nested dicts (MMOPD's per-domain rows) as domains/math/rkl
                    for k, v in d.items():
                        if isinstance(v, dict):
                            yield from flat(v, f"{pre}{k}/")
                        elif (isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1)) and k != "step":
                            yield f"{pre}{k}", float(v)
                self.wb.log(dict(flat(row)), step=int(row["step"]))

    def finish(self):
        if self.wb is not None:
            self.wb.finish()
            self.wb = None


def check_wandb(project: str | None):
    """UsageError, before any work, when --wandb is given and the wandb package is not installed."""
    import importlib.util
    if project and importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb needs the wandb package: pip install wandb (or drop --wandb; metrics.jsonl is "
                         "written either way)")


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (the object itself when not distributed)."""
    if not sharded():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier():
    if sharded():
        dist.barrier()


def _trainable_only(model, msd: dict) -> tuple:
    """(the entries of state dict msd that train, whether some weights are frozen): a LoRA run's backbone never
    changes, so its resume state holds the adapter alone."""
    if all(p.requires_grad for p in model.parameters()):
        return msd, False
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in msd.items() if k in trainable}, True


def save_train_state(path: str, model, opt, extra: dict, recipe: dict | None = None):
    """Everything needed to resume training beside the checkpoint, as a torch.distributed.checkpoint directory: every
    rank writes its own shards of the model and optimizer state (no gather to one process: at 8B the full fp32 state
    is ~98 GB), and a restart loads them on the same or another number of ranks, or in one process (DCP reshards).
    Only the trainable weights when some are frozen (a LoRA run's backbone never changes). Rank 0 adds extra.pt: the
    RNG states and `extra` (step, data cursor, ...); and first `recipe` (check_run_files compares it). Atomic: written
    into a temporary directory, renamed when whole. Every rank must call it."""
    import torch.distributed.checkpoint as dcp
    msd, osd = get_state_dict(model, opt)   # sharded (DTensor) under FSDP2, plain tensors otherwise
    msd, _ = _trainable_only(model, msd)
    tmp = f"{path}.tmp-{broadcast_object(tmp_tag())}"   # one temporary name for all ranks
    if rank() == 0:
        if recipe is not None:
            save_json(recipe_file(path), recipe)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    with _single_process_quiet():
        dcp.save(dict(model=msd, optim=osd), checkpoint_id=tmp)
    if rank() == 0:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        # only tensors and plain Python values, so that it loads with torch.load(weights_only=True)
        torch.save(dict(extra=extra, torch_rng=torch.get_rng_state(), py_rng=random.getstate(),
                        np_rng=dict(name=name, keys=torch.from_numpy(keys.astype(np.int64)), pos=int(pos),
                                    has_gauss=int(has_gauss), gauss=float(gauss))),
                   os.path.join(tmp, "extra.pt"))
        old = f"{tmp}.old"
        if os.path.isdir(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_train_state(path: str, model, opt) -> dict:
    """Restore what save_train_state wrote into `model` and `opt`, whatever the number of ranks that saved it (every
    rank reads the parts of the shards it now holds); returns `extra`. Every rank must call it."""
    import torch.distributed.checkpoint as dcp
    msd, osd = get_state_dict(model, opt)   # the layout to fill (the optimizer's state is initialised if empty)
    msd, partial = _trainable_only(model, msd)   # saved without the frozen weights
    with _single_process_quiet():
        dcp.load(dict(model=msd, optim=osd), checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=StateDictOptions(strict=not partial))
    state = torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=True)
    torch.set_rng_state(state["torch_rng"])
    v, internal, gauss = state["py_rng"]
    random.setstate((v, tuple(internal), gauss))
    r = state["np_rng"]
    np.random.set_state((r["name"], r["keys"].numpy().astype(np.uint32), r["pos"], r["has_gauss"], r["gauss"]))
    return state["extra"]


def drop_train_state(out: str):
    """Remove the resume state and its recipe once the checkpoint `out` is saved (rank 0)."""
    if rank() == 0:
        state, recipe, _ = run_files(out)
        shutil.rmtree(state, ignore_errors=True)
        if os.path.exists(recipe):
            os.remove(recipe)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP in one process warns that it "assumes the intent is to load in a single process": it is the intent."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the project's root (where the scripts are)


def source_hash(files) -> str:
    """A short hash of source files (paths relative to the project root, in the order given) and their contents: what
    a record says it was computed by (evaluate.scoring_code, analyze.inputs_of), so a change to that code makes it
    stale and a change elsewhere does not."""
    import hashlib
    h = hashlib.sha256()
    for f in files:
        with open(os.path.join(ROOT, f), "rb") as fh:
            h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()[:16]


def source_files(*patterns) -> list:
    """The project's files matching each glob pattern (relative to the project root), each pattern's matches sorted."""
    return [os.path.relpath(p, ROOT) for pat in patterns for p in sorted(glob.glob(os.path.join(ROOT, pat)))]


def code_revision() -> str:
    """The git commit of this code (with '+dirty' when the tree has changes), or 'unknown'."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def numerics() -> dict:
    """What a result's floating-point path depends on beyond the code, the settings and the seed, stamped on every
    checkpoint's acl_meta.json and evaluation record: the same command on another CPU (another kernel dispatch) or at
    another thread count (another reduction order) samples other tokens from the first update on (docs/LOG.md,
    2026-12-07: seed 0 at one commit, re-run in another session, differed from its first RL step; within a run, two
    identical trainings are bit-identical, and the run directory's path changes nothing)."""
    import platform

    import transformers
    if torch.cuda.is_available():
        device = f"cuda {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        device = f"cpu {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "threads": torch.get_num_threads()}


def write_atomically(out_dir: str, write) -> str:
    """Call write(tmp) on a temporary sibling directory, fsync it, then rename it to out_dir (and fsync the parent):
    a half-written checkpoint
    never exists under its final name, and an existing one is replaced only after the new one is whole, and only
    if it is a checkpoint this project wrote (acl_meta.json) or an empty directory (scripts check their targets
    with check_output before any work; this is the last line of defence)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{tmp_tag()}-{int(time.time() * 1000)}")
    os.makedirs(tmp)
    try:
        write(tmp)
        fsync(tmp)
        old = None
        if os.path.lexists(out_dir):
            if not os.path.isdir(out_dir) or (os.listdir(out_dir) and not read_meta(out_dir)):
                raise UsageError(f"{out_dir} exists and is not a checkpoint this project wrote: not replacing it")
            old = tmp + ".old"
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        fsync(parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def copy_checkpoint(src: str, out: str):
    """A finished checkpoint's files copied whole into out, acl_meta.json included (so its identity is the source's):
    rank 0 writes it atomically (write_atomically), every rank waits."""
    if rank() == 0:
        write_atomically(out, lambda tmp: [shutil.copy2(os.path.join(src, f), tmp) for f in os.listdir(src)
                                           if os.path.isfile(os.path.join(src, f))])
    barrier()


def write_meta(ckpt_dir: str, meta: dict):
    """acl_meta.json of a checkpoint being written, stamped with the code revision, numerics(), the time and a save
    id."""
    meta = dict(meta, code_revision=code_revision(), numerics=numerics(), saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                save_id=uuid.uuid4().hex[:16])   # two saves in one second are two parents too (identity)
    with open(os.path.join(ckpt_dir, "acl_meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True, default=str)


def save_checkpoint(out_dir: str, model, tokenizer, meta: dict, state_dict: dict | None = None, dtype=None):
    """Write a Hugging Face checkpoint (safetensors + config + tokenizer) plus acl_meta.json, atomically
    (write_atomically). For a sharded model pass state_dict=full_state_dict(model) and call this on rank 0 only.
    dtype (e.g. torch.bfloat16, --save-dtype): the floating-point weights are cast to it, and config.json says so, so
    that vLLM and `dtype="auto"` load them as such (an 8B stage: 16 GB, not 33 GB in fp32); None keeps the model's."""
    if dtype is not None:
        sd = state_dict if state_dict is not None else model.state_dict()
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}

    def write(tmp):
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if dtype is not None:
            with open(os.path.join(tmp, "config.json")) as f:
                cfg = json.load(f)
            cfg["dtype"] = str(dtype).removeprefix("torch.")
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_meta(tmp, meta)
    return write_atomically(out_dir, write)


def save_policy(out_dir: str, model, tokenizer, meta, dtype=None):
    """A training script's checkpoint, called on every rank: the weights gathered to rank 0 (full_state_dict), rank 0
    writes them (save_checkpoint), and every rank waits at a barrier
    until the directory exists. Without the barrier the other ranks went straight on to load it as the next stage's
    parent while rank 0 was still writing (about a minute at 8B): every multi-rank run died crossing a stage."""
    sd = full_state_dict(model)
    if rank() == 0:
        save_checkpoint(out_dir, model, tokenizer, meta, state_dict=sd, dtype=dtype)
    barrier()
    return out_dir


def save_final(out_dir: str, model, tokenizer, meta: dict, dtype, t0: float):
    """The end of a run that makes one checkpoint (sdft.py, mmopd.py), on every rank: save_policy, then its resume
    state dropped and one line; a failed write stops the run in one line."""
    try:
        save_policy(out_dir, model, tokenizer, meta, dtype=dtype)
    except OSError as e:
        sys.exit(f"error: writing {out_dir} failed: {e}")
    drop_train_state(out_dir)
    print0(f"saved {out_dir} in {time.time() - t0:.0f}s")


def tokenizer_hash(path: str) -> str:
    """A fingerprint of a checkpoint's tokenizer (its vocabulary and special tokens): two checkpoints whose token ids
    mean the same tokens have the same one."""
    import hashlib

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    return hashlib.sha256(json.dumps([sorted(tok.get_vocab().items()), tok.all_special_tokens]).encode()).hexdigest()


def newest(path: str) -> float:
    """When the newest file under `path` was written (0 if none): outputs made after it are up to date."""
    return max((os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs), default=0.0)


def identity(path: str | None) -> str | None:
    """What a child records of its parent so that a parent replaced in place makes the child stale (lineage by
    identity, not by path): a hash of every acl_meta.json under the directory (each holds its save time, code
    revision and recipe, so every save differs; an MLE directory's experts and router included), else of its files'
    names, sizes and modification times (a model made elsewhere, a data file: a file rewritten is another), else the name itself (a hub id, or a path
    not made yet); None for none."""
    import hashlib
    if not path or not os.path.exists(path):
        return path or None
    h = hashlib.sha256()
    metas = sorted(os.path.relpath(os.path.join(r, f), path) for r, ds, fs in os.walk(path)
                   for f in fs if f == "acl_meta.json" and not os.path.basename(r).startswith("."))
    for m in metas:
        h.update(m.encode() + b"\0" + open(os.path.join(path, m), "rb").read() + b"\0")
    if not metas:
        for f in sorted(os.listdir(path)) if os.path.isdir(path) else [""]:
            st = os.stat(os.path.join(path, f) if f else path)
            h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, "acl_meta.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- the run skeleton

def start_run(a, line: str, outs: list, files=()):
    """A training script's start, once its flags and data are checked: --threads, the process group (-> the device),
    `line` and the resolved config printed once, and on rank 0 the sweep of what killed writers of `outs` and `files`
    left (remove_leftovers)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    device = init_dist(a.dist_timeout, bf16=a.bf16)
    print0(f"{line}, {world_size()} process(es)\nresolved config: {vars(a)}")
    if rank() == 0:
        remove_leftovers(outs, files=files)
    return device


def resume_state(path: str, model, opt, label: str) -> dict | None:
    """The extras a killed run saved with its resume state at `path` (run_files(out)[0]), loaded into model and opt;
    None when there is none (a fresh start)."""
    if not os.path.exists(path):
        return None
    extra = load_train_state(path, model, opt)
    print0(f"{label} resumed at step {extra['step']} from {path}")
    return extra


def stop_diverged(out: str, message: str, e: Exception):
    """A non-finite loss, gradient or weight (FloatingPointError e): checkpoint `out` is marked diverged (a restart
    refuses to continue it) and the run stops with one line, `message`; nothing non-finite was saved."""
    if rank() == 0:
        mark_diverged(out, str(e))
    sys.exit(f"error: {message}")


# ----------------------------------------------------------------------------- loading a policy

def resolve_attn(attn: str) -> str:
    """--attn auto: flash_attention_2 where flash-attn is installed and a GPU is there, sdpa otherwise."""
    if attn != "auto":
        return attn
    import importlib.util
    return "flash_attention_2" if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else "sdpa"


def checkpoint_activations(model):
    """Activation checkpointing, non-reentrant (the only kind that composes with FSDP2's hooks), through
    whichever name this transformers has (activation_checkpointing_enable from 5.2x, gradient_... before)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def uses_activation_checkpointing(model) -> bool:
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def load_policy(path: str, device, attn: str = "sdpa", grad_ckpt: bool = False, dtype=torch.float32):
    """(model, tokenizer) from a HF checkpoint, fp32 master weights by default (FSDP2's MixedPrecisionPolicy
    casts for compute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=resolve_attn(attn))
    model = model.to(device)
    if grad_ckpt:
        checkpoint_activations(model)
    return model, tok


# ----------------------------------------------------------------------------- checkpoints tensor by tensor
# safetensors by hand: an 8-byte header length, a JSON header {name: {dtype, shape, data_offsets}}, the bytes.
# Reading one tensor is a seek and a read (no mmap, so pages of a checkpoint do not pile up in memory): merge.py
# and analyze.py stream over 8B checkpoints this way.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_header(path: str) -> tuple:
    """(header without __metadata__, offset of the data section) of a .safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensor(path: str, name: str, headers: dict, rows: tuple | None = None) -> torch.Tensor:
    """One tensor of a .safetensors file (headers: a cache of read_header by path); rows=(start, stop) reads
    only those rows of its first dimension."""
    if path not in headers:
        headers[path] = read_header(path)
    header, data = headers[path]
    info = header[name]
    start, end = info["data_offsets"]
    shape = list(info["shape"])
    if rows is not None:
        row_bytes = (end - start) // shape[0]
        start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
        shape[0] = rows[1] - rows[0]
    with open(path, "rb") as f:
        f.seek(data + start)
        buf = bytearray(f.read(end - start))
    dtype = DTYPES[info["dtype"]]
    return torch.frombuffer(buf, dtype=dtype).reshape(shape) if buf else torch.empty(shape, dtype=dtype)


def shard_files(ckpt: str) -> dict:
    """tensor name -> safetensors file of a HF checkpoint directory (one file or an index of shards)."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(ckpt, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(ckpt, "model.safetensors")
    if not os.path.isfile(single):
        raise UsageError(f"no safetensors weights in {ckpt} (model.safetensors or its index)")
    return {name: single for name in read_header(single)[0]}


def checkpoint_tensors(ckpt: str):
    """Yield (name, tensor) for every tensor of a HF checkpoint, one at a time, read by seek: how evaluate.py
    pushes checkpoint after checkpoint into one vLLM engine without loading a model."""
    files, headers = shard_files(ckpt), {}
    for name, path in files.items():
        yield name, read_tensor(path, name, headers)


def tensor_infos(files: dict) -> dict:
    """tensor name -> {dtype, shape, data_offsets} over a checkpoint's shards (files: shard_files())."""
    out = {}
    for path in sorted(set(files.values())):
        out.update(read_header(path)[0])
    return {name: out[name] for name in files}


def same_tensors(base: str, ckpts: list) -> dict:
    """{checkpoint: {tensor name: file}} for the base and ckpts; UsageError unless every checkpoint has
    safetensors weights with the base's tensor names and shapes."""
    files = {c: shard_files(c) for c in [base, *ckpts]}
    infos = {c: tensor_infos(f) for c, f in files.items()}
    for m in ckpts:
        if set(infos[m]) != set(infos[base]):
            extra = sorted(set(infos[m]) ^ set(infos[base]))[0]
            raise UsageError(f"mismatched architectures: tensor {extra} is in only one of {m} and the base")
        for name, info in infos[base].items():
            if infos[m][name]["shape"] != info["shape"]:
                raise UsageError(f"mismatched architectures: {name} is {infos[m][name]['shape']} in {m}, "
                                 f"{info['shape']} in the base")
    return files

