// kube-apiserver as Kubernetes builds it (k8s.io/kubernetes/cmd/kube-apiserver/apiserver.go), from the modules
// pinned in ../../go.mod.
package main

import (
	"os"
	_ "time/tzdata" // for timeZone support in CronJob, as upstream

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format, as upstream
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as upstream
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric, as upstream
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	command := app.NewAPIServerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
