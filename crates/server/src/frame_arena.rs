//! A conversation's frame blocks: while it streams in bursts, its new
//! events' frames are written one after another into blocks of a few KiB
//! rather than each into an allocation of its own.
//!
//! Why: at saturation a sixth of the server's CPU went to freeing an
//! event's allocations (its record, its frame, the header `bytes` gives a
//! frame at its first clone) when the replay buffer let the event go:
//! memory last touched thousands of events earlier, often allocated by
//! another thread, whose heap's lock the free then took. In a block, an
//! event's frame costs no allocation, a copy of it handed to a connection
//! is a count on its block (no allocation either), and one free gives
//! back the frames of a whole block. Paced traffic, a few events per
//! conversation at a time, keeps one allocation per frame: there, each
//! frame written into its conversation's block lands in memory no other
//! recent event touched, and that cost more than the allocations it saved
//! (BENCHMARKS.md, item 36).
//!
//! Memory: a block lives while any frame in it is held (by the replay
//! buffer, a connection's queue, a write in flight). Beyond the frames
//! their holders count (as if each had its allocation, see
//! `EventRecord::held_bytes`), a conversation's blocks keep the unused
//! room of the block being filled and the frames already let go of the
//! oldest block still held: at most [`MAX_BLOCK`] each. The room left at
//! the end of a full block (less than [`MAX_FRAME`]) and the block's own
//! header are less, per frame in it, than what that count adds to each
//! frame for an allocation it does not have (at least 40 bytes).

use bytes::BytesMut;
use tokio_tungstenite::tungstenite::Utf8Bytes;

/// The first block of a burst.
pub const MIN_BLOCK: usize = 2 * 1024;

/// The largest block: each next block is twice the last, up to this.
pub const MAX_BLOCK: usize = 16 * 1024;

/// A frame larger than this gets an allocation of its own, so that the
/// room a block is left with when the next frame does not fit stays
/// small next to what the block holds: a block of [`MIN_BLOCK`] holds at
/// least eight frames, and its end and header are then under 40 bytes a
/// frame. A demo token's frame is about 195 bytes.
pub const MAX_FRAME: usize = 256;

/// One conversation's block being filled. It is kept between bursts, so
/// that a conversation has one block with unused room at most.
#[derive(Debug, Default)]
pub struct FrameArena {
    /// The unused room of the block being filled (empty: no block).
    block: BytesMut,
    /// The size of the next block.
    next_block: usize,
}

impl FrameArena {
    /// A copy of `frame`: the next bytes of the block being filled (a new
    /// block when it has no room left), or an allocation of its own when
    /// it is larger than [`MAX_FRAME`].
    pub fn place(&mut self, frame: &str) -> Utf8Bytes {
        if frame.len() > MAX_FRAME {
            return Utf8Bytes::from(frame.to_owned());
        }
        if self.block.capacity() - self.block.len() < frame.len() {
            let size = self.next_block.max(MIN_BLOCK);
            self.block = BytesMut::with_capacity(size);
            self.next_block = (size * 2).min(MAX_BLOCK);
        }
        self.block.extend_from_slice(frame.as_bytes());
        let placed = self.block.split().freeze();
        // SAFETY: the bytes are a copy of a `str`, whole.
        unsafe { Utf8Bytes::from_bytes_unchecked(placed) }
    }
}

/// Whether `next` starts where `frame` ends: the two share a block.
#[cfg(test)]
pub(crate) fn follows(frame: &Utf8Bytes, next: &Utf8Bytes) -> bool {
    frame.as_ptr().wrapping_add(frame.len()) == next.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(size: usize) -> String {
        "x".repeat(size)
    }

    #[test]
    fn small_frames_follow_each_other_in_a_block_and_a_large_one_has_its_own() {
        let mut arena = FrameArena::default();
        let first = arena.place(&frame(200));
        let second = arena.place("second");
        let large = arena.place(&frame(MAX_FRAME + 1));
        let third = arena.place("third");
        assert_eq!(
            [first.as_str(), second.as_str(), third.as_str()],
            [frame(200).as_str(), "second", "third"]
        );
        assert_eq!(large.as_str(), frame(MAX_FRAME + 1));
        assert!(
            follows(&first, &second),
            "the second frame follows the first"
        );
        assert!(
            !follows(&second, &large),
            "a large frame is not in the block"
        );
        assert!(follows(&second, &third), "the block goes on after it");
    }

    #[test]
    fn blocks_double_up_to_the_largest() {
        let mut arena = FrameArena::default();
        let size = 256;
        let mut frames = vec![arena.place(&frame(size))];
        let mut blocks = vec![1];
        for _ in 0..(4 * MAX_BLOCK / size) {
            let next = arena.place(&frame(size));
            let previous = frames.last().expect("placed");
            if follows(previous, &next) {
                *blocks.last_mut().expect("a block") += 1;
            } else {
                blocks.push(1);
            }
            frames.push(next);
        }
        let per_block = |bytes: usize| bytes / size;
        assert_eq!(
            blocks[..4],
            [
                per_block(MIN_BLOCK),
                per_block(2 * MIN_BLOCK),
                per_block(4 * MIN_BLOCK),
                per_block(MAX_BLOCK)
            ]
        );
        assert!(blocks[4..blocks.len() - 1]
            .iter()
            .all(|&n| n == per_block(MAX_BLOCK)));
        // Every frame kept its bytes while later ones were written.
        assert!(frames
            .iter()
            .all(|f| f.len() == size && f.bytes().all(|b| b == b'x')));
    }

    #[test]
    fn a_frame_outlives_its_arena_and_the_other_frames() {
        let mut arena = FrameArena::default();
        let kept = arena.place("kept");
        let dropped = arena.place("dropped");
        drop((arena, dropped));
        assert_eq!(kept.as_str(), "kept");
    }
}
