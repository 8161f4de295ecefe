"""The model (an MLP of one hidden layer), its training and evaluation, and the data: the node's
own shard (``data-path`` of its node config, an ``.npz`` with ``x_train``, ``y_train``,
``x_test``, ``y_test``) or, without one, a synthetic partition."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

N_FEATURES = 64  # the digits dataset: 8x8 images
N_CLASSES = 10
torch.set_num_threads(1)  # one core a node: the nodes of a host share its cores


class Net(nn.Module):
    """64 features -> ``hidden`` ReLU units -> 10 classes (logits)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def initial_model(hidden: int, seed: int = 0) -> Net:
    """The model every SuperNode starts from (the ServerApp sends its ``state_dict``)."""
    torch.manual_seed(seed)
    return Net(hidden)


def _samples(x: np.ndarray) -> torch.Tensor:
    x = x.reshape(len(x), -1)
    x = (x / 255.0) if x.dtype == np.uint8 else x
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def load_data(node_config: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test) of this node, as tensors."""
    path = node_config.get("data-path")
    if path:
        with np.load(str(path), allow_pickle=False) as d:
            return (_samples(d["x_train"]), torch.from_numpy(d["y_train"].astype(np.int64)),
                    _samples(d["x_test"]), torch.from_numpy(d["y_test"].astype(np.int64)))
    pid, parts = int(node_config.get("partition-id", 0)), int(node_config.get("num-partitions", 1))
    rng = np.random.default_rng(1234)  # the same classes everywhere, a different share per partition
    centres = rng.normal(size=(N_CLASSES, N_FEATURES)).astype(np.float32)
    mine = np.random.default_rng(pid + 7 * parts)
    y = mine.integers(0, N_CLASSES, 400)
    x = centres[y] + mine.normal(scale=4.0, size=(len(y), N_FEATURES)).astype(np.float32)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    return xt[:300], yt[:300], xt[300:], yt[300:]


def train(net: Net, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, lr: float,
          seed: int = 0) -> float:
    """Mini-batch SGD with momentum, ``epochs`` passes over (x, y); the mean loss of the last pass."""
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    total = 0.0
    for _ in range(epochs):
        total = 0.0
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            optimiser.zero_grad()
            loss = loss_fn(net(x[batch]), y[batch])
            loss.backward()
            optimiser.step()
            total += loss.item() * len(batch)
    return total / max(len(y), 1)


@torch.no_grad()
def evaluate(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) on ``x``, ``y``."""
    net.eval()
    logits = net(x)
    loss = float(nn.functional.cross_entropy(logits, y))
    return loss, float((logits.argmax(dim=1) == y).float().mean())
