"""``Lead``: what one FSDP unit hands the next, so that their collectives overlap compute, in order."""

from jaxdp.strategies.ties import zero_of


class Lead:
    """What one unit hands the next so that their collectives overlap compute, one unit ahead, in order.

    Two float scalars of value zero, carried as a data dependence (XLA reorders and combines
    collectives freely otherwise):

    - ``gather``, forward: made from the unit's input and its gathered params. The next unit's
      gather waits for it, so it starts as this unit starts computing (FSDP2's forward
      prefetch), never earlier (at most two units' params alive), and never before this unit's
      own gather is done (XLA's all-gather combiner cannot merge the two into one that waits for
      both). Backward, its cotangent comes from the next unit's backward *first thing* (made from
      that unit's output cotangent and re-gathered params): this unit's re-gather waits for it
      instead of its own output cotangent, so it runs while the next unit's backward computes
      (FSDP2's backward prefetch), one at a time;
    - ``scatter``: its cotangent comes from the next unit's reduce-scattered gradient: this
      unit's reduce-scatter waits for it, so the reduce-scatters run one per unit, each as its
      unit's backward ends, instead of one combined reduce-scatter after the whole backward.

    A ``Lead`` no later unit received (the last unit's) gets a symbolic zero for cotangent: no
    dependence to wait for (a gather tied to a constant zero could be hoisted anywhere), so that
    unit re-gathers as its own forward ends instead (``units.regathered``).
    """

    def __init__(self, gather, scatter, root: bool = False):
        self.gather, self.scatter, self.root = gather, scatter, root

    @classmethod
    def of_root(cls) -> "Lead":
        """The first unit's: no previous unit to follow (its gather may start at once). Backward, the first
        unit's input cotangent waits for its reduce-scatter, so that the root's reduce-scatter (after
        the stem's backward) follows every unit's: else XLA merges it with the last unit's, which then
        waits for the whole backward. (Tying the first unit's gather to the root's gathered params made
        XLA lay the stem's activations out anew: 227 more transposes, compiled for H100s.)"""
        return cls(zero_of([]), zero_of([]), root=True)

    def arrays(self):
        return (self.gather, self.scatter)
