"""arealjax entry point.

  python main.py --config=configs/default.py --workdir=/tmp/arealjax [--config.a.b=value ...] [--debug]

Every failure ends in one paragraph on stderr that names the config key, file or line at fault, and a non-zero exit
code (1: an error, 2: a bad flag or config key, 130: Ctrl-C, 143: SIGTERM); `--debug` shows the traceback too.
"""

import sys

from arealjax import runtime

STOP = runtime.install_signal_handlers()  # first: a Ctrl-C during the imports below must not be lost either

import logging  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402

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


def fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with ml_collections' traceback for an unknown config key turned into one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e} (python main.py --helpfull lists the flags)", 2)
    except (AttributeError, KeyError) as e:  # --config.a.b=v where b is not a key of the config
        text = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
        key = re.match(r"'?([^'\s]+)'?", text)
        given = [a.split("=")[0] for a in argv if key and re.search(rf"\.{re.escape(key.group(1))}(=|$)",
                                                                     a.split("=")[0])]
        fail(f"{given[0] if given else 'a --config flag'}: no such config key. {text}", 2)
    except Exception as e:  # noqa: BLE001 — a config file that does not load
        fail(f"--config: {e}", 2)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments: {argv[1:]}", 2)
    config, debug = flags.FLAGS.config, flags.FLAGS.debug
    try:
        STOP.check()
        f = flags.FLAGS
        runtime.setup(config, f.coordinator, f.num_processes, f.process_id)  # before JAX starts: its flags
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # quiet "no TPU found" probes on CPU
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every step of every save at INFO
        from arealjax import serve, train

        STOP.check()
        if flags.FLAGS.export_to:
            serve.export(config, flags.FLAGS.workdir, flags.FLAGS.export_to)
        else:
            train.run(config, flags.FLAGS.workdir, stop=STOP)
    except runtime.Interrupted as e:
        # train.run has stopped the controller, the generator loop and the reward workers and written the summary
        print(f"interrupted ({e}): generator, reward workers and controller stopped; metrics and summary.json are "
              f"in {flags.FLAGS.workdir}", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    except Exception as e:  # noqa: BLE001 — one paragraph instead of a traceback
        if debug:
            traceback.print_exc()
        fail(runtime.error_text(e) + ("" if debug else "\n(run with --debug for the traceback)"), 1)
    finally:
        if flags.FLAGS.coordinator or config.get("distributed", False):
            from arealjax import distributed

            distributed.shutdown()  # a barrier: no process leaves while the others still need the coordinator


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
