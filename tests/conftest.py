import torch

# One thread: two threads collapse when the 2-core machine is shared.
torch.set_num_threads(1)
