"""Parallelism: how devices, processes and hosts share a run.

    sharding.py     the device mesh (fsdp x tp), the params' and batches' partition specs
    roles.py        which devices train and which sample (``mesh.rollout_devices``), and the
                    copy of the trainer's params the sampler serves
    hosts.py        the work split across JAX processes and what they exchange (identity on
                    one process)
    distributed.py  starting and joining the processes of a multi-host run
"""
