"""The stages around RL: pre-training, warm start, chat SFT, DPO and reward models."""
