"""Workflows: one dataset sample -> one trajectory, by talking to the generator, rewards and sandbox (base.py)."""

from arealjax.workflows.base import Episode, Prompt, Turns, Workflow, load_workflow, user_turn
from arealjax.workflows.multi_turn import MultiTurn
from arealjax.workflows.rlvr import RLVR
from arealjax.workflows.tool import ToolCalls

__all__ = ["Episode", "MultiTurn", "Prompt", "RLVR", "ToolCalls", "Turns", "Workflow", "load_workflow", "user_turn"]
