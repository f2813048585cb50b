"""``batchd.IterableDataset``: a Loader for frameworks that insist on a ``DataLoader``.

Wrap the Loader and hand it to ``DataLoader(ds, batch_size=None, num_workers=0)``: the
batches are already made (``batch_size=None`` turns off the DataLoader's own batching) and
already decoded by the server's workers. DataLoader workers would each run the whole
Loader, i.e. serve every sample once per worker, so iterating inside one is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from batchd._device import Batch
from batchd._loader import Loader
from batchd.errors import FailedPrecondition, InvalidArgument

__all__ = ["IterableDataset"]

_T = TypeVar("_T")

_IN_WORKER = (
    "batchd.IterableDataset was iterated inside a DataLoader worker, which would serve every "
    "sample once per worker: use DataLoader(ds, batch_size=None, num_workers=0); batchd "
    "already decodes in its own workers"
)

if TYPE_CHECKING:
    from torch.utils.data import IterableDataset as _Base
else:
    try:
        from torch.utils.data import IterableDataset as _Base
    except ImportError:  # torch is optional for the client

        class _Base(Generic[_T]):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise FailedPrecondition(
                    "batchd.IterableDataset needs torch, which is not installed; install "
                    "batchd[torch], or iterate the batchd.Loader itself"
                )


class IterableDataset(_Base[Batch]):
    """A ``torch.utils.data.IterableDataset`` whose items are a :class:`batchd.Loader`'s batches.

    Args:
        loader: The Loader to iterate; the dataset does not close it.

    Use ``DataLoader(ds, batch_size=None, num_workers=0)``. ``len(ds)`` is ``len(loader)``;
    ``set_epoch``, ``state_dict`` and ``load_state_dict`` are the Loader's.
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

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(state)
