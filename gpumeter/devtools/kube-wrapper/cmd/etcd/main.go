// etcd as etcd builds it (go.etcd.io/etcd/server/v3/main.go), at the version pinned in ../../go.mod.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
