"""Your own Keras model, as in EdgeTB's ``nns/`` files: ``build`` returns a compiled model.

In a structure file: ``"model": {"kind": "keras", "module": "nns/keras_cnn.py", "filters": 16}``;
the testbed wraps it (fit, evaluate, get and set weights) and seeds TensorFlow with the run's
seed before ``build``, so every node starts from the same weights.
"""
import tensorflow as tf


def build(input_shape, n_classes, conf):
    filters = int(conf.get("filters", 16))
    model = tf.keras.Sequential([
        tf.keras.Input(shape=input_shape),
        tf.keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(n_classes),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(float(conf.get("learning_rate", 0.001))),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model
