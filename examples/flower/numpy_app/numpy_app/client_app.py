"""The ClientApp: trains and evaluates on this node's data."""
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from numpy_app import task

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    x, y, _, _ = task.load_data(context.node_config)
    weights = msg.content["arrays"].to_numpy_ndarrays()
    weights, loss = task.train(weights, x, y, int(context.run_config["local-epochs"]),
                               float(context.run_config["learning-rate"]))
    content = RecordDict({"arrays": ArrayRecord(weights),
                          "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)})})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, _, x, y = task.load_data(context.node_config)
    loss, accuracy = task.evaluate(msg.content["arrays"].to_numpy_ndarrays(), x, y)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(y)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
