"""`reasoning_content`: a reasoning model's `<think>…</think>` returned apart from its answer, as
DeepSeek's API and vLLM's reasoning parsers do, streamed as deltas of its own.

The text of a chat turn is split as it arrives: what is inside the tags is reasoning, the rest content;
the tags themselves are neither. A turn whose prompt already opened the tag (DeepSeek-R1's templates end
the generation prompt with "<think>\\n") starts inside it. Text that could be the start of a tag is held
back until it cannot (tags often arrive in pieces: "<th", "ink>"), and leading whitespace of each part is
dropped (Qwen3 writes "<think>\\n" and "</think>\\n\\n").

Which models: `mode` "auto" splits where the vocabulary has both tags as tokens (Qwen3, DeepSeek-R1 and
their distills), "on" always, "off" never (the tags stay in the content).
"""

OPEN, CLOSE = "<think>", "</think>"
MODES = ("auto", "on", "off")


def splits_reasoning(mode: str, tokens) -> bool:
    """Whether a server in `mode` splits reasoning for a vocabulary of `tokens`."""
    if mode not in MODES:
        raise ValueError(f"reasoning mode {mode!r} (choose from {', '.join(MODES)})")
    return mode == "on" or (mode == "auto" and OPEN in tokens and CLOSE in tokens)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an opened tag (the generation prompt wrote "<think>")."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ReasoningSplitter:
    """feed(text) -> (reasoning, content) deltas; finish() -> what was held back."""

    def __init__(self, inside: bool = False):
        self.state = "reasoning" if inside else "start"  # start: nothing but whitespace seen yet
        self.held = ""
        self.strip = True  # the part just begun drops its leading whitespace

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        pending = self.held + text
        self.held = ""
        while pending:
            if self.state == "start":
                s = pending.lstrip()
                if not s:
                    self.held = pending  # only whitespace so far: the answer may still open a tag
                    return "".join(reasoning), "".join(content)
                if s.startswith(OPEN):
                    self.state, self.strip, pending = "reasoning", True, s[len(OPEN):]
                    continue
                if OPEN.startswith(s):  # "<thi": the tag may be coming
                    self.held = pending
                    return "".join(reasoning), "".join(content)
                self.state, self.strip = "content", False  # no tag: the whole turn is content
                continue
            if self.strip:
                pending = pending.lstrip()
                if not pending:
                    break
                self.strip = False
            if self.state == "content":
                content.append(pending)
                break
            at = pending.find(CLOSE)
            if at >= 0:
                reasoning.append(pending[:at])
                self.state, self.strip, pending = "content", True, pending[at + len(CLOSE):]
                continue
            keep = max((k for k in range(1, len(CLOSE)) if pending.endswith(CLOSE[:k])), default=0)
            reasoning.append(pending[:len(pending) - keep])
            self.held = pending[len(pending) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back, at the end of the turn: a tag that never completed is text."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held.lstrip() if self.state == "start" else held
