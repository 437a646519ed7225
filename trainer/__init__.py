"""The trainer's plumbing, used by train.py and sft.py (it imports nothing from the top-level files).

    policy_sampler.py  the run's inference copy of the policy and its kept engine; the weight sync (refresh)
"""
