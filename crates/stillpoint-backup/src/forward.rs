//! The methods an OpenDAL layer of the store passes to the service below unchanged,
//! written once for every layer (`forward_to_inner!(info, compose, …)` inside an
//! `impl Service`; the service keeps the one below in a field called `inner`).

/// Expands to `Service` methods that call `self.inner`'s of the same name.
macro_rules! forward_to_inner {
    ($($method:ident),* $(,)?) => { $( $crate::forward::forward_to_inner!(@ $method); )* };
    (@info) => {
        fn info(&self) -> ServiceInfo {
            self.inner.info()
        }
    };
    (@compose) => {
        fn compose(&self, ctx: &OperationContext, to: &str, args: OpCompose) -> Result<Self::Composer> {
            self.inner.compose(ctx, to, args)
        }
    };
    (@create_dir) => {
        async fn create_dir(&self, ctx: &OperationContext, path: &str, args: OpCreateDir) -> Result<RpCreateDir> {
            self.inner.create_dir(ctx, path, args).await
        }
    };
    (@stat) => {
        async fn stat(&self, ctx: &OperationContext, path: &str, args: OpStat) -> Result<RpStat> {
            self.inner.stat(ctx, path, args).await
        }
    };
    (@read) => {
        fn read(&self, ctx: &OperationContext, path: &str, args: OpRead) -> Result<Self::Reader> {
            self.inner.read(ctx, path, args)
        }
    };
    (@copy) => {
        fn copy(&self, ctx: &OperationContext, from: &str, to: &str, args: OpCopy) -> Result<Self::Copier> {
            self.inner.copy(ctx, from, to, args)
        }
    };
    (@list) => {
        fn list(&self, ctx: &OperationContext, path: &str, args: OpList) -> Result<Self::Lister> {
            self.inner.list(ctx, path, args)
        }
    };
    (@delete) => {
        fn delete(&self, ctx: &OperationContext) -> Result<Self::Deleter> {
            self.inner.delete(ctx)
        }
    };
    (@rename) => {
        async fn rename(&self, ctx: &OperationContext, from: &str, to: &str, args: OpRename) -> Result<RpRename> {
            self.inner.rename(ctx, from, to, args).await
        }
    };
    (@restore) => {
        async fn restore(&self, ctx: &OperationContext, path: &str, args: OpRestore) -> Result<RpRestore> {
            self.inner.restore(ctx, path, args).await
        }
    };
    (@presign) => {
        async fn presign(&self, ctx: &OperationContext, path: &str, args: OpPresign) -> Result<RpPresign> {
            self.inner.presign(ctx, path, args).await
        }
    };
}

pub(crate) use forward_to_inner;
