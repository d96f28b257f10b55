"""The library every script shares (as nanochat's nanochat/ package): imports nothing of the scripts, and envs/
imports nothing of it.

    common.py      processes, FSDP2, files, atomic checkpoints, lineage
    step.py        episodes -> tensors -> token log-probs -> one update with a method's loss_fn
    engine.py      the HF inference engine (kept KV caches, continuous batching), make_backend, the weight push
    vllm.py        the colocated vLLM engine: sleep/wake, weight push, LoRA
    scale.py       --dry-run (memory and time of a full-scale run) and --check-install
    forgetting.py  the accuracy matrix, BWT/FWT, paired SEs, tables, heatmap (no torch)
    routing.py     serving an MLE directory: experts, the tag or learned router, blends
"""
