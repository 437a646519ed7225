"""The sampler's engine: generic (no text-to-SQL in it), used through trainer/policy_sampler.py and rollout.py.

    engine.py         Engine: schedule -> run -> postprocess, one forward (or decode window) per step()
    scheduler.py      Sequence and continuous batching: which sequences the next forward runs
    block_manager.py  the KV pool's blocks: allocation, sharing between a prompt's samples, copy on write
    model_runner.py   a forward's inputs and attention metadata, the forward, the samples
    sampling.py       per-token sampling (counter-based noise) and the incremental stop-string checker
    cuda_graphs.py    CUDA graphs of the decode forward, one per (batch, blocks) bucket
    paged_attention.py  the paged KV cache and the model's attention over it (model.forward_paged)
"""
