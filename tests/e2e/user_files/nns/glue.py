from nn_fashion_mnist import nn
def build(input_shape, n_classes, conf): return nn.model
