//! [`NatsStore`]: linger's [`crate::store::Store`] over JetStream (to come).
