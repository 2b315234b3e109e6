"""Generation: the slot engine (JetStream Engine API shape) and the interruptible generator that drives it."""

from arealjax.api import Completion, SamplingParams
from arealjax.generation.engine import DecodeState, Engine, Prefix, SlotSampling
from arealjax.generation.generator import Generator, GeneratorStats

__all__ = ["Completion", "DecodeState", "Engine", "Generator", "GeneratorStats", "Prefix", "SamplingParams",
           "SlotSampling"]
