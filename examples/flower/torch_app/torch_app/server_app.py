"""The ServerApp: FedAvg over every SuperNode for ``num-server-rounds`` rounds, starting from the
MLP's ``state_dict``."""
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from torch_app import task

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    strategy = FedAvg(fraction_train=float(config["fraction-train"]),
                      fraction_evaluate=float(config.get("fraction-evaluate", 1.0)))
    net = task.initial_model(int(config["hidden-units"]))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                            num_rounds=int(config["num-server-rounds"]))
    net.load_state_dict(result.arrays.to_torch_state_dict())
    print(f"final model: {sum(p.numel() for p in net.parameters())} parameters")
