"""A model file shaped as EdgeTB's ``nns/`` files are: the model is built and compiled when the
module is imported, held by a module-level object (``nn.model``), batch normalisation at Keras'
default momentum (0.99). Used as it is; a user adds only the glue file beside it."""
from tensorflow.keras import Model
from tensorflow.keras.layers import BatchNormalization, Conv2D, Dense, Flatten, Input, MaxPooling2D


class FashionMnist:
    def __init__(self):
        inputs = Input(shape=(28, 28, 1))
        x = Conv2D(32, 3, padding="same", activation="relu")(inputs)
        x = BatchNormalization()(x)
        x = Conv2D(32, 3, padding="same", activation="relu")(x)
        x = BatchNormalization()(x)
        x = MaxPooling2D(2)(x)
        x = Conv2D(64, 3, padding="same", activation="relu")(x)
        x = BatchNormalization()(x)
        x = MaxPooling2D(2)(x)
        x = Flatten()(x)
        x = Dense(64, activation="relu")(x)
        outputs = Dense(10, activation="softmax")(x)
        self.model = Model(inputs, outputs)
        self.model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])


nn = FashionMnist()
