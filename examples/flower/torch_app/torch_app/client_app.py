"""The ClientApp: trains and evaluates the MLP on this node's data."""
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from torch_app import task

app = ClientApp()


def _model(msg: Message, context: Context) -> task.Net:
    net = task.Net(int(context.run_config["hidden-units"]))
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return net


@app.train()
def train(msg: Message, context: Context) -> Message:
    x, y, _, _ = task.load_data(context.node_config)
    net = _model(msg, context)
    config = context.run_config
    loss = task.train(net, x, y, int(config["local-epochs"]), int(config["batch-size"]),
                      float(config["learning-rate"]), seed=int(context.node_config.get("partition-id", 0)))
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                          "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)})})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, _, x, y = task.load_data(context.node_config)
    loss, accuracy = task.evaluate(_model(msg, context), x, y)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(y)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
