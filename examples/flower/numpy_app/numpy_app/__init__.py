"""A softmax regression in numpy, federated with Flower's FedAvg."""
