"""The names of the two mesh axes (`rstar2_jax.parallel.sharding`): rows of a batch split over `fsdp`,
heads (and the MLP's and the vocabulary's columns) over `tp`. Defined here because the model's
TPU kernels, which XLA does not partition, split their work over the same axes
(`tpu_attention`)."""

FSDP = "fsdp"
TP = "tp"
