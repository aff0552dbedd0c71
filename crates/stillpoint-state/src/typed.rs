//! Typed state over raw bytes: keys and values encoded with postcard (serde).

use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{KeyedState, StateError};

fn encode<T: Serialize>(state: &str, value: &T) -> Result<Vec<u8>, StateError> {
    postcard::to_allocvec(value).map_err(|e| StateError::Codec {
        state: state.into(),
        message: e.to_string(),
    })
}

fn decode<T: DeserializeOwned>(state: &str, bytes: &[u8]) -> Result<T, StateError> {
    postcard::from_bytes(bytes).map_err(|e| StateError::Codec {
        state: state.into(),
        message: e.to_string(),
    })
}

/// A value per key, e.g. a running count per word.
#[derive(Clone, Debug)]
pub struct ValueState<K, V> {
    name: String,
    types: PhantomData<fn(K) -> V>,
}

impl<K: Serialize, V: Serialize + DeserializeOwned> ValueState<K, V> {
    /// The state called `name` (a column family).
    #[must_use]
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            types: PhantomData,
        }
    }

    /// The value of `key`.
    pub fn get(&self, store: &impl KeyedState, key: &K) -> Result<Option<V>, StateError> {
        let key = encode(&self.name, key)?;
        store
            .get(&self.name, &key, &[])?
            .map(|bytes| decode(&self.name, &bytes))
            .transpose()
    }

    /// Sets the value of `key`.
    pub fn put(&self, store: &mut impl KeyedState, key: &K, value: &V) -> Result<(), StateError> {
        let (key, value) = (encode(&self.name, key)?, encode(&self.name, value)?);
        store.put(&self.name, &key, &[], &value)
    }

    /// Deletes the value of `key`.
    pub fn delete(&self, store: &mut impl KeyedState, key: &K) -> Result<(), StateError> {
        let key = encode(&self.name, key)?;
        store.delete(&self.name, &key, &[])
    }
}

/// A map per key, e.g. the open windows of a user.
#[derive(Clone, Debug)]
pub struct MapState<K, F, V> {
    name: String,
    types: PhantomData<fn(K, F) -> V>,
}

impl<K: Serialize, F: Serialize + DeserializeOwned, V: Serialize + DeserializeOwned>
    MapState<K, F, V>
{
    /// The state called `name` (a column family).
    #[must_use]
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            types: PhantomData,
        }
    }

    /// Entry `field` of `key`.
    pub fn get(
        &self,
        store: &impl KeyedState,
        key: &K,
        field: &F,
    ) -> Result<Option<V>, StateError> {
        let (key, field) = (encode(&self.name, key)?, encode(&self.name, field)?);
        store
            .get(&self.name, &key, &field)?
            .map(|bytes| decode(&self.name, &bytes))
            .transpose()
    }

    /// Sets entry `field` of `key`.
    pub fn put(
        &self,
        store: &mut impl KeyedState,
        key: &K,
        field: &F,
        value: &V,
    ) -> Result<(), StateError> {
        let (key, field, value) = (
            encode(&self.name, key)?,
            encode(&self.name, field)?,
            encode(&self.name, value)?,
        );
        store.put(&self.name, &key, &field, &value)
    }

    /// Deletes entry `field` of `key`.
    pub fn delete(
        &self,
        store: &mut impl KeyedState,
        key: &K,
        field: &F,
    ) -> Result<(), StateError> {
        let (key, field) = (encode(&self.name, key)?, encode(&self.name, field)?);
        store.delete(&self.name, &key, &field)
    }

    /// Every entry of `key` (in the order of the fields' encodings).
    pub fn entries(&self, store: &impl KeyedState, key: &K) -> Result<Vec<(F, V)>, StateError> {
        let key = encode(&self.name, key)?;
        store
            .fields(&self.name, &key)?
            .into_iter()
            .map(|(field, value)| Ok((decode(&self.name, &field)?, decode(&self.name, &value)?)))
            .collect()
    }
}
