"""Training policies that change the model between optimizer steps: Quantile Balancing (router biases) and QK-Clip
(MLA query/key weights). Each records through hooks it attaches, updates from an optimizer step hook, and has a
Trainer callback that only attaches, logs and detaches."""
