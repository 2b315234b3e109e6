"""arealjax entry point.

  python main.py --config=configs/default.py --workdir=/tmp/arealjax [--config.a.b=value ...]
"""

import logging

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "A config file with get_config().", lock_config=True)
flags.DEFINE_string("workdir", "/tmp/arealjax", "Directory for outputs (checkpoints, metrics, exported model).")
flags.DEFINE_string("export_to", "", "Instead of training: write the latest checkpoint's params to this directory "
                    "as a Hugging Face checkpoint (safetensors + config.json + tokenizer) for serving.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = flags.FLAGS.config
    from arealjax import runtime  # JAX must not start before runtime.setup has set its flags

    runtime.setup(config)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # quiet "no TPU found" probes on CPU
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every step of every save at INFO
    from arealjax import train

    if flags.FLAGS.export_to:
        train.export(config, flags.FLAGS.workdir, flags.FLAGS.export_to)
        return
    try:
        train.run(config, flags.FLAGS.workdir)
    except KeyboardInterrupt:
        # train.run has already stopped the controller, the generator loop and the reward workers
        logging.error("interrupted: generator, reward workers and controller stopped; metrics so far are in %s",
                      flags.FLAGS.workdir)
        raise SystemExit(130) from None


if __name__ == "__main__":
    app.run(main)
