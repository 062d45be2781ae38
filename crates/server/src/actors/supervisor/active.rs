//! The conversations this node runs, with an index by user. The per-user
//! limit is checked at every activation; counting a user's conversations
//! by walking all of them made activating N conversations O(N²) (10,000
//! activations spent seconds of the supervisor's time comparing user
//! names). The index is kept here, next to the map it indexes, so that
//! no code path can change one without the other.

use std::collections::hash_map::{self, HashMap};
use std::sync::Arc;

use super::Entry;

/// What the index needs of an entry: whose it is. An entry's user never
/// changes while it is in the map.
pub(super) trait Owned {
    fn user(&self) -> &Arc<str>;
}

impl Owned for Entry {
    fn user(&self) -> &Arc<str> {
        &self.user
    }
}

pub(super) struct ActiveConversations<E = Entry> {
    by_id: HashMap<Arc<str>, E>,
    /// Every id of `by_id`, under its entry's user. A user holds a handful
    /// (the per-user limit plus those stopping), so scanning one set is
    /// cheap.
    by_user: HashMap<Arc<str>, Vec<Arc<str>>>,
}

impl<E> Default for ActiveConversations<E> {
    fn default() -> Self {
        ActiveConversations {
            by_id: HashMap::new(),
            by_user: HashMap::new(),
        }
    }
}

impl<E: Owned> ActiveConversations<E> {
    pub(super) fn insert(&mut self, id: Arc<str>, entry: E) {
        let user = entry.user().clone();
        if let Some(old) = self.by_id.insert(id.clone(), entry) {
            self.unindex(old.user(), &id);
        }
        // Most users have one active conversation: room for one, not the
        // four a first push reserves.
        self.by_user
            .entry(user)
            .or_insert_with(|| Vec::with_capacity(1))
            .push(id);
    }

    pub(super) fn remove(&mut self, id: &str) -> Option<E> {
        let entry = self.by_id.remove(id)?;
        self.unindex(entry.user(), id);
        Some(entry)
    }

    fn unindex(&mut self, user: &str, id: &str) {
        if let Some(ids) = self.by_user.get_mut(user) {
            ids.retain(|i| &**i != id);
            if ids.is_empty() {
                self.by_user.remove(user);
            }
        }
    }

    /// `user`'s conversations, stopping ones included.
    pub(super) fn of_user<'a>(
        &'a self,
        user: &str,
    ) -> impl Iterator<Item = (&'a Arc<str>, &'a E)> + 'a {
        self.by_user
            .get(user)
            .into_iter()
            .flatten()
            .filter_map(|id| self.by_id.get_key_value(id))
    }

    pub(super) fn get(&self, id: &str) -> Option<&E> {
        self.by_id.get(id)
    }

    /// The entry, to change what it says. Callers set `stopping` and
    /// `observers`; an entry's `user` never changes (the index depends on
    /// it).
    pub(super) fn get_mut(&mut self, id: &str) -> Option<&mut E> {
        self.by_id.get_mut(id)
    }

    pub(super) fn contains_key(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub(super) fn iter(&self) -> hash_map::Iter<'_, Arc<str>, E> {
        self.by_id.iter()
    }

    pub(super) fn keys(&self) -> hash_map::Keys<'_, Arc<str>, E> {
        self.by_id.keys()
    }

    pub(super) fn values(&self) -> hash_map::Values<'_, Arc<str>, E> {
        self.by_id.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(Arc<str>);

    impl Owned for Fake {
        fn user(&self) -> &Arc<str> {
            &self.0
        }
    }

    fn ids_of(active: &ActiveConversations<Fake>, user: &str) -> Vec<String> {
        let mut ids: Vec<String> = active.of_user(user).map(|(id, _)| id.to_string()).collect();
        ids.sort();
        ids
    }

    #[test]
    fn a_users_conversations_follow_inserts_and_removes() {
        let mut active = ActiveConversations::default();
        for (id, user) in [("c1", "ann"), ("c2", "bob"), ("c3", "ann"), ("c4", "ann")] {
            active.insert(Arc::from(id), Fake(Arc::from(user)));
        }
        assert_eq!(ids_of(&active, "ann"), ["c1", "c3", "c4"]);
        assert_eq!(ids_of(&active, "bob"), ["c2"]);
        assert!(ids_of(&active, "cy").is_empty());

        assert!(active.remove("c3").is_some());
        assert!(active.remove("c3").is_none());
        assert_eq!(ids_of(&active, "ann"), ["c1", "c4"]);

        active.remove("c2");
        assert!(ids_of(&active, "bob").is_empty());
        assert!(
            !active.by_user.contains_key("bob"),
            "an empty user is dropped"
        );
        assert_eq!(active.len(), 2);
    }

    #[test]
    fn inserting_an_id_again_moves_it_to_its_new_user() {
        let mut active = ActiveConversations::default();
        active.insert(Arc::from("c1"), Fake(Arc::from("ann")));
        active.insert(Arc::from("c1"), Fake(Arc::from("bob")));
        assert!(ids_of(&active, "ann").is_empty());
        assert_eq!(ids_of(&active, "bob"), ["c1"]);
        assert_eq!(active.len(), 1);
    }
}
