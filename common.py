"""Plumbing shared by every script, and nothing else: seeding, rank-0 printing, and checkpoints that
are written atomically with their acl_meta.json.

(torchrun init/teardown and FSDP2 wrapping join this file with the training scripts.)
"""
import json
import os
import random
import shutil
import subprocess
import time

import numpy as np
import torch


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def print0(*args, **kwargs):
    if rank() == 0:
        print(*args, **kwargs, flush=True)


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


def save_checkpoint(out_dir: str, model, tokenizer, meta: dict):
    """Write a Hugging Face checkpoint (safetensors + config + tokenizer) plus acl_meta.json into a
    temporary sibling directory, then rename it into place: a half-written checkpoint never exists
    under its final name. An existing checkpoint at out_dir is replaced only after the new one is whole."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{os.getpid()}-{int(time.time() * 1000)}")
    os.makedirs(tmp)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        meta = dict(meta, code_revision=code_revision(), saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        with open(os.path.join(tmp, "acl_meta.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True, default=str)
        old = None
        if os.path.exists(out_dir):
            old = tmp + ".old"
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, "acl_meta.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
