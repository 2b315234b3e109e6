"""arealjax entry point.

  python main.py --config=configs/default.py --workdir=/tmp/arealjax [--config.a.b=value ...] [--debug]

Every failure ends in one paragraph on stderr that names the config key, file or line at fault, and a non-zero exit
code (1: an error, 2: a bad flag or config key, 130: Ctrl-C, 143: SIGTERM); `--debug` shows the traceback too.
"""


from arealjax import runtime

STOP = runtime.install_signal_handlers()  # first: a Ctrl-C during the imports below must not be lost either

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

config_flags.DEFINE_config_file("config", None, "A config file with get_config().", lock_config=True)
flags.DEFINE_string("workdir", "/tmp/arealjax", "Directory for outputs (checkpoints, metrics, exported model).")
flags.DEFINE_string("export_to", "", "Instead of training: write the latest checkpoint's params to this directory "
                    "as a Hugging Face checkpoint (safetensors + config.json + tokenizer) for serving.")
flags.DEFINE_bool("debug", False, "Show the traceback of an error, not only its message.")
flags.DEFINE_string("coordinator", "", "Multi-host without a cluster environment (GPU hosts): host:port of process "
                    "0, the same on every process (TPU pods and SLURM: leave empty, set --config.distributed=True).")
flags.DEFINE_integer("num_processes", 0, "Multi-host: the number of processes (one per host), with --coordinator.")
flags.DEFINE_integer("process_id", -1, "Multi-host: this process's index, 0 … num_processes − 1, with --coordinator.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        runtime.fail(f"unexpected arguments: {argv[1:]}", 2)
    config, f = flags.FLAGS.config, flags.FLAGS
    runtime.log_above_bars()

    def body():
        STOP.check()
        runtime.setup(config, f.coordinator, f.num_processes, f.process_id)  # before JAX starts: its flags
        from arealjax import export, train

        STOP.check()
        if f.export_to:
            export.export(config, f.workdir, f.export_to)
        else:
            train.run(config, f.workdir, stop=STOP)

    try:  # train.run has stopped the controller, the generator loop and the reward workers on a signal
        runtime.guarded(body, f.debug, f"generator, reward workers and controller stopped; metrics and "
                        f"summary.json are in {f.workdir}")
    finally:
        if f.coordinator or config.distributed:
            from arealjax import distributed

            distributed.shutdown()  # a barrier: no process leaves while the others still need the coordinator


if __name__ == "__main__":
    app.run(main, flags_parser=runtime.parse_flags)
