"""A small PyTorch MLP, federated with Flower's FedAvg."""
