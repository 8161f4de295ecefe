"""Your own PyTorch model: ``build`` returns a ``torch.nn.Module`` that maps a batch of images
(channels first, as PyTorch has them: the testbed transposes its channels-last samples) to logits.

In a structure file: ``"model": {"module": "nns/torch_cnn.py", "filters": 16, "learning_rate": 0.003}``
(``"kind": "torch"`` may be left out: a module is unambiguous). The testbed trains it with the
model conf's optimizer (``adam``, or ``sgd`` with ``momentum`` and ``weight_decay``) and
cross-entropy, evaluates it, and sends its ``state_dict``'s float entries by their keys; it seeds
torch with the run's seed before it imports this file, so every node starts from the same weights.
``make_optimizer(model, conf)`` and ``loss(logits, labels)`` here, when defined, replace the
optimizer and the loss.
"""
import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, channels, height, width, n_classes, filters):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, filters, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(filters), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(filters * (height // 2) * (width // 2), 32), nn.ReLU(), nn.Linear(32, n_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def build(input_shape, n_classes, conf):
    height, width, channels = input_shape  # the testbed's samples: (height, width, channels)
    return SmallCNN(channels, height, width, n_classes, int(conf.get("filters", 16)))


def make_optimizer(model, conf):
    return torch.optim.Adam(model.parameters(), lr=float(conf.get("learning_rate", 0.003)))
