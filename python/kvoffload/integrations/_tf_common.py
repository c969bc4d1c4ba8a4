"""What the transformers tier's parts share: the record of a GPU block's
key, a preempted request's partial block, and a prompt's identity."""



def _prompt_ident(prompt_ids, matched, bs):
    """What identifies a waiting request's prompt for the miss memo beyond
    its id and length: the list object and the tokens of the block the
    chain missed at (a request id reused with another prompt differs)."""
    g = matched // bs
    return id(prompt_ids), hash(tuple(prompt_ids[g * bs:(g + 1) * bs]))


class _Entry:
    """The kvoffload key of one complete GPU block, valid while the block
    keeps transformers' hash h."""
    __slots__ = ("h", "key", "parent")

    def __init__(self, h, key, parent):
        self.h, self.key, self.parent = h, key, parent


class _Tail:
    """A preempted request's last, partly filled block, stored under key:
    tokens of the block (ntok of them) after the nfull full blocks."""
    __slots__ = ("nfull", "ntok", "key")

    def __init__(self, nfull, ntok, key):
        self.nfull, self.ntok, self.key = nfull, ntok, key
