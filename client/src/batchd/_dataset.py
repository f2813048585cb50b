"""``batchd.IterableDataset`` and ``batchd.DataLoader``: a Loader for code that insists on
torch's ``Dataset`` or ``DataLoader``.

The batches are already made and already decoded by the server's workers, so the wrapping
DataLoader must not batch again (``batch_size=None``) nor run workers of its own: DataLoader
workers would each run the whole Loader, i.e. serve every sample once per worker, so
iterating inside one is refused.

Resuming is the part that differs between wrappers. A framework saves the position of the
object it was given, and only if that object has ``state_dict``/``load_state_dict``
(Lightning checks for both, torchdata's ``StatefulDataLoader`` asks its dataset). A plain
``torch.utils.data.DataLoader`` has neither, so a checkpoint taken mid-epoch holds no data
position and the resumed run starts the epoch over (Lightning says so in a "not resumable"
warning, and then sees fewer batches than the epoch has left). ``batchd.DataLoader`` is
that ``DataLoader`` with the Loader's ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from batchd._device import Batch
from batchd._loader import Loader
from batchd.errors import FailedPrecondition, InvalidArgument

__all__ = ["DataLoader", "IterableDataset"]

_T = TypeVar("_T")

_IN_WORKER = (
    "batchd.IterableDataset was iterated inside a DataLoader worker, which would serve every "
    "sample once per worker: use DataLoader(ds, batch_size=None, num_workers=0); batchd "
    "already decodes in its own workers"
)

if TYPE_CHECKING:
    from torch.utils.data import DataLoader as _TorchLoader
    from torch.utils.data import IterableDataset as _Base
else:
    try:
        from torch.utils.data import DataLoader as _TorchLoader
        from torch.utils.data import IterableDataset as _Base
    except ImportError:  # torch is optional for the client

        class _Base(Generic[_T]):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise FailedPrecondition(
                    f"batchd.{type(self).__name__} needs torch, which is not installed; "
                    "install batchd[torch], or iterate the batchd.Loader itself"
                )

        _TorchLoader = _Base


class _LoaderState:
    """The position methods of a wrapper of :attr:`loader`: the Loader's own."""

    loader: Loader

    def set_epoch(self, epoch: int) -> None:
        """The Loader's ``set_epoch``."""
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The Loader's :meth:`~batchd.Loader.state_dict`: where the next batch comes from."""
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The Loader's :meth:`~batchd.Loader.load_state_dict`."""
        self.loader.load_state_dict(state)


class IterableDataset(_LoaderState, _Base[Batch]):
    """A ``torch.utils.data.IterableDataset`` whose items are a :class:`batchd.Loader`'s batches.

    Args:
        loader: The Loader to iterate; the dataset does not close it.

    Wrap it in :class:`batchd.DataLoader` (resumable under Lightning and anything that
    checkpoints the dataloader) or torchdata's ``StatefulDataLoader(ds, batch_size=None)``
    (which saves its dataset's state). A plain ``torch.utils.data.DataLoader(ds,
    batch_size=None)`` iterates it too, but has no state: a mid-epoch checkpoint of it
    restarts the epoch. ``len(ds)`` is ``len(loader)``; ``set_epoch``, ``state_dict`` and
    ``load_state_dict`` are the Loader's.
    """

    def __init__(self, loader: Loader) -> None:
        if not isinstance(loader, Loader):
            raise InvalidArgument(f"loader={loader!r} must be a batchd.Loader")
        super().__init__()
        self.loader = loader

    def __iter__(self) -> Iterator[Batch]:
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            raise InvalidArgument(_IN_WORKER)
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class DataLoader(_LoaderState, _TorchLoader[Batch]):
    """A ``torch.utils.data.DataLoader`` of a :class:`batchd.Loader`'s batches that resumes.

    Args:
        loader: The :class:`batchd.Loader` (or a :class:`batchd.IterableDataset` of one);
            the DataLoader does not close it.
        collate_fn: Applied to each batch (a dict of tensors); default as torch's with
            ``batch_size=None``: NumPy arrays become tensors, tensors stay as they are.
        pin_memory: Copy each batch into pinned memory (torch's option; the Loader's
            ``device="cuda"`` already delivers through pinned buffers).

    It is ``DataLoader(batchd.IterableDataset(loader), batch_size=None, num_workers=0)``
    with :meth:`state_dict` and :meth:`load_state_dict` of the Loader, so Lightning (which
    checkpoints a dataloader only if it has both) and any loop that saves its dataloader
    resume a mid-epoch checkpoint at exactly the next batch. Use it where a framework wants
    a ``torch.utils.data.DataLoader``; the README says which form suits which framework.
    """

    def __init__(
        self,
        loader: Loader | IterableDataset,
        collate_fn: Any = None,
        pin_memory: bool = False,
    ) -> None:
        dataset = loader if isinstance(loader, IterableDataset) else IterableDataset(loader)
        super().__init__(
            dataset, batch_size=None, num_workers=0, collate_fn=collate_fn, pin_memory=pin_memory
        )
        self.loader = dataset.loader
        """The wrapped Loader."""
