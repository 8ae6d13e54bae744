"""The ablation suite: a matrix of training jobs, each changing one K3 design choice against the default job."""
