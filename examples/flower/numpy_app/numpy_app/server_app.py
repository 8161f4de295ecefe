"""The ServerApp: FedAvg over every SuperNode for ``num-server-rounds`` rounds."""
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from numpy_app import task

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    strategy = FedAvg(fraction_train=float(config["fraction-train"]),
                      fraction_evaluate=float(config.get("fraction-evaluate", 1.0)))
    initial = task.initial_weights(int(config.get("padding-values", 0)))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial),
                            num_rounds=int(context.run_config["num-server-rounds"]))
    print(f"final weights: {sum(a.size for a in result.arrays.to_numpy_ndarrays())} values")
