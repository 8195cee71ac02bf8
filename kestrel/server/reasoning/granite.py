"""granite: Granite 3.2's "Here is my thought process:" ... "Here is my response:" (also "Here's")."""
from kestrel.server.reasoning.base import ReasoningParser


class GraniteReasoningParser(ReasoningParser):
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")
