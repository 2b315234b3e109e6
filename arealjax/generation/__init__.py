"""Generation: the slot engine (JetStream Engine API shape) and the interruptible generator that drives it."""

from arealjax.generation.engine import DecodeState, Engine, Prefix, SamplingParams, SlotSampling
from arealjax.generation.generator import Completion, Generator, GeneratorStats

__all__ = ["Completion", "DecodeState", "Engine", "Generator", "GeneratorStats", "Prefix", "SamplingParams",
           "SlotSampling"]
