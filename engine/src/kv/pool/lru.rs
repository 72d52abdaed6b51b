//! An intrusive doubly-linked list over ids `0..n`, the LRU order of the block pool's free
//! lists and of the host tier's slots. Owns only the order of ids; what an id stands for (a
//! block, a host slot) and when it moves is its user's.

/// "No block" in the intrusive lists.
const NIL: u32 = u32::MAX;

/// An intrusive doubly-linked list over ids `0..n`: O(1) push at the back, pop at the front,
/// and removal of any member. The front is the least recently pushed id.
#[derive(Clone)]
pub(crate) struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    pub(crate) fn new(n: usize) -> Self {
        assert!(n < NIL as usize, "at most {} ids", NIL - 1);
        Self {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            linked: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.linked[id as usize]
    }

    /// Append `id` (must not be in the list) as the most recent member.
    pub(crate) fn push_back(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(!self.linked[i], "id {id} is already in the list");
        self.linked[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.len += 1;
    }

    /// Remove `id` (must be in the list).
    pub(crate) fn remove(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(self.linked[i], "id {id} is not in the list");
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
    }

    /// Move `id` (must be in the list) to the back (most recent).
    pub(crate) fn move_to_back(&mut self, id: u32) {
        if self.tail != id {
            self.remove(id);
            self.push_back(id);
        }
    }

    /// Remove and return the least recent member.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }

    /// Members from least to most recent.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let id = at;
            at = self.next[id as usize];
            Some(id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_list_orders_and_removes() {
        let mut l = LruList::new(5);
        for id in [3, 1, 4, 0] {
            l.push_back(id);
        }
        assert_eq!(l.iter().collect::<Vec<_>>(), [3, 1, 4, 0]);
        l.remove(1);
        l.remove(0);
        assert_eq!(l.iter().collect::<Vec<_>>(), [3, 4]);
        l.move_to_back(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), [4, 3]);
        assert!(l.contains(3) && !l.contains(1));
        assert_eq!(l.pop_front(), Some(4));
        assert_eq!(l.pop_front(), Some(3));
        assert_eq!(l.pop_front(), None);
        assert_eq!(l.len(), 0);
        l.push_back(2);
        assert_eq!(l.iter().collect::<Vec<_>>(), [2]);
    }
}
