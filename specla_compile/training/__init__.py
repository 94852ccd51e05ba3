"""Training helpers for the project's own GDN target and its drafters: corpora, and a PyTorch chunked
gated delta rule for training where fla's chunk kernels are refused."""

TRAINER_STATE = "trainer_state.pt"  # a training script's step and optimizer state in its --out, for --resume
